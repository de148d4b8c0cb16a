"""The documented rule table on loose files, confidence levels, the
explicit-dtype case, clean twins of the new rules, and --min-confidence."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from training_profiler.amp_checker import checker as sc
from training_profiler.amp_checker.catalog import RULES
from training_profiler.amp_checker.rules import RULES as BASE_RULES
from training_profiler.amp_checker.rules import Confidence

HERE = Path(__file__).parent
SEED = HERE / "profiler_seed"
GOLDEN = HERE / "profiler_golden"
PROJECT = HERE / "profiler_project"
SEED_ROWS = {"AMP001", "AMP002", "AMP003", "AMP004", "AMP005", "AMP006"}


def _marks(folder: Path) -> set[tuple[str, int, str]]:
    return {(f.name, n, m.group(1)) for f in folder.glob("*.py")
            for n, line in enumerate(f.read_text().splitlines(), 1) if (m := re.search(r"# seed: (AMP\d{3})", line))}


def test_every_seed_row_fires_on_loose_files() -> None:
    report = sc.check_paths([SEED])
    assert not report.project_mode and report.min_confidence == Confidence.LOW and report.hidden == 0
    found = {(Path(f.path).name, f.line, f.rule_id) for f in report.findings}
    marks = _marks(SEED)
    assert {r for _, _, r in marks} == SEED_ROWS
    assert marks <= found, marks - found


def test_no_training_seen_is_said_and_ranked_low() -> None:
    findings, _ = sc.check_source((SEED / "attention.py").read_text(), "attention.py")
    by_line = {(f.line, f.rule_id): f for f in findings}
    cast = by_line[(6, "AMP001")]
    assert cast.confidence == Confidence.LOW and "no training seen; if this runs under AMP" in cast.message
    softmax = by_line[(7, "AMP004")]  # float16 by the file's own cast: sure whoever trains it
    assert softmax.confidence == Confidence.HIGH and "float16 value" in softmax.message
    assert by_line[(13, "AMP006")].confidence == Confidence.LOW
    high_only, _ = sc.check_source((SEED / "attention.py").read_text(), "attention.py",
                                   min_confidence=Confidence.HIGH)
    assert [(f.line, f.rule_id) for f in high_only] == [(7, "AMP004")]


def test_project_mode_shows_high_only_by_default() -> None:
    default = sc.check_paths([PROJECT])
    everything = sc.check_paths([PROJECT], min_confidence=Confidence.LOW)
    assert default.project_mode and default.min_confidence == Confidence.HIGH
    assert all(f.confidence == Confidence.HIGH for f in default.findings)
    assert len(everything.findings) == len(default.findings) + default.hidden


def test_explicit_float32_dtype_is_silent() -> None:
    source = (GOLDEN / "AMP005_explicit_dtype.py").read_text()
    assert sc.check_source(source, "x.py")[0] == []
    lowp = source.replace(", dtype=torch.float32)\n        loss", ")\n        loss")
    assert lowp != source
    assert [(f.line, f.rule_id) for f in sc.check_source(lowp, "x.py")[0]] == [(10, "AMP005")]


def test_every_new_rule_and_extension_has_a_golden_and_a_clean_twin() -> None:
    twins = sorted(GOLDEN.glob("*_clean.py"))
    assert len(twins) >= 7
    for twin in twins:
        assert twin.with_suffix(".expected").read_text().strip() == "", twin.name
        bad = twin.with_name(twin.name.replace("_clean", ""))
        rule = bad.name[:6]
        assert f" {rule} " in bad.with_suffix(".expected").read_text(), bad.name
    new = {r.id for r in RULES} - {r.id for r in BASE_RULES}
    assert new and new <= {t.name[:6] for t in twins}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "training_profiler.amp_checker.checker", *args],
                          capture_output=True, text=True)


def test_min_confidence_flag() -> None:
    low = _cli(str(SEED / "attention.py"), "--format", "json")
    high = _cli(str(SEED / "attention.py"), "--format", "json", "--min-confidence", "high")
    low_j, high_j = json.loads(low.stdout), json.loads(high.stdout)
    assert {f["confidence"] for f in low_j["findings"]} == {"low", "high"}
    assert [f["rule"] for f in high_j["findings"]] == ["AMP004"] and high_j["hidden"] >= 4
    text = _cli(str(SEED / "attention.py"), "--min-confidence", "medium").stdout
    assert "not shown (--min-confidence low shows them)" in text
    bad = _cli(str(SEED), "--min-confidence", "sure")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
