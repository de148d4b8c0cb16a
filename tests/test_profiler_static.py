"""Static AMP checker: golden output per rule, formats, suppression, selection, exit codes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quant.vocabulary import Severity
from training_profiler import findings_report as fr
from training_profiler.amp_checker import checker as sc
from training_profiler.amp_checker.catalog import RULES

GOLDEN = Path(__file__).parent / "profiler_golden"
CASES = sorted(GOLDEN.glob("*.py"))


def _line_output(path: Path) -> str:
    findings, err = sc.check_source(path.read_text(), path.name)
    report = fr.Report(findings=findings, errors=[err] if err else [], files_checked=1)
    return fr.format_line(report)


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_golden(case: Path) -> None:
    expected = case.with_suffix(".expected").read_text().strip()
    assert _line_output(case) == expected


def test_every_rule_has_a_golden_file_that_fires_it() -> None:
    fired = set()
    for case in CASES:
        fired |= set(re.findall(r" (AMP\d{3}) ", case.with_suffix(".expected").read_text()))
    assert fired == {r.id for r in RULES}
    for r in RULES:  # every rule is fully described
        assert r.explanation and r.suggestion and isinstance(r.severity, Severity)


def test_alias_resolution_and_scope() -> None:
    src = (
        "import torch as T\n"
        "import torch.nn.functional as Fn\n"
        "from torch import autocast as ac\n"
        "with ac('cpu', dtype=T.bfloat16):\n"
        "    y = Fn.softmax(T.randn(2, 2), -1)\n"
        "    z = Fn.softmax(T.randn(2, 2), -1, dtype=T.float32)\n"
        "@T.autocast('cpu')\n"
        "def f(x):\n"
        "    return T.nn.functional.log_softmax(x, 0)\n"
    )
    findings, err = sc.check_source(src)
    assert err is None
    assert [(f.rule_id, f.line) for f in findings] == [("AMP004", 5), ("AMP004", 9)]


def test_suppression_forms() -> None:
    base = ("import torch\nscaler = torch.amp.GradScaler('cuda')\nx = torch.ones(2).half(){}\n"
            "scaler.scale(x.float().sum()).backward()\n")
    assert len(sc.check_source(base.format(""))[0]) == 1
    assert sc.check_source(base.format("  # amp-check: ignore"))[0] == []
    assert sc.check_source(base.format("  # amp-check: ignore[AMP001]"))[0] == []
    assert sc.check_source(base.format("  # amp-check: ignore[manual-cast]"))[0] == []
    assert len(sc.check_source(base.format("  # amp-check: ignore[AMP004]"))[0]) == 1


def test_rule_selection() -> None:
    src = (GOLDEN / "AMP005_reduction.py").read_text()
    only = sc.select_rules(["AMP001"])
    assert {f.rule_id for f in sc.check_source(src, rules=only)[0]} == {"AMP001"}
    without = sc.select_rules(None, ["reduction-outside-autocast"])
    assert {f.rule_id for f in sc.check_source(src, rules=without)[0]} == {"AMP001"}
    with pytest.raises(ValueError, match="unknown rule 'AMP999'"):
        sc.select_rules(["AMP999"])


def test_text_format_matches_seed_layout() -> None:
    report = sc.check_paths([GOLDEN / "AMP002_bce.py"])
    text = fr.format_text(report)
    assert text.startswith(f"File: {GOLDEN / 'AMP002_bce.py'}\n")
    assert "Line 5: [HIGH] AMP002 BCELoss usage in AMP code\n  -> " in text
    assert "\n  -> Suggestion: Use binary_cross_entropy_with_logits" in text


def test_json_format_round_trips() -> None:
    report = sc.check_paths([GOLDEN / "AMP010_clip.py", GOLDEN / "syntax_error.py"])
    data = json.loads(fr.format_json(report))
    assert data["files_checked"] == 2
    assert [(f["rule"], f["line"], f["severity"]) for f in data["findings"]] == [("AMP010", 7, "MEDIUM")]
    assert data["errors"][0]["path"].endswith("syntax_error.py") and data["errors"][0]["line"] == 2


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "training_profiler.amp_checker.checker", *args],
                          capture_output=True, text=True)


def test_cli_exit_codes_and_threshold() -> None:
    medium_only = str(GOLDEN / "AMP010_clip.py")
    assert _cli(medium_only).returncode == 0                      # default --fail-on high
    assert _cli(medium_only, "--fail-on", "medium").returncode == 1
    assert _cli(str(GOLDEN / "AMP008_bf16_ok.py"), "--fail-on", "low").returncode == 0
    r = _cli(str(GOLDEN / "AMP001_manual_cast.py"), "--format", "line")
    assert r.returncode == 1 and r.stdout.count(": AMP001 ") == 4


def test_cli_syntax_error_is_reported_and_skipped(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("def f(:\n")
    (tmp_path / "ok.py").write_text("import torch\nwith torch.autocast('cpu'):\n    y = torch.ones(2).half()\ny.float().sum().backward()\n")
    r = _cli(str(tmp_path), "--format", "line")
    assert r.returncode == 1
    assert "ok.py:3:9: AMP001" in r.stdout
    assert "bad.py:1:0: E999 syntax error" in r.stdout
    assert "Traceback" not in r.stderr


def test_cli_usage_errors_are_one_line() -> None:
    r = _cli("does/not/exist.py")
    assert r.returncode == 2 and "does/not/exist.py: no such file" in r.stderr and "Traceback" not in r.stderr
    r = _cli(str(GOLDEN), "--select", "NOPE")
    assert r.returncode == 2 and "unknown rule 'NOPE'" in r.stderr
    assert _cli("--help").returncode == 0
    assert "AMP012" in _cli("--list-rules").stdout


PROJECT = Path(__file__).parent / "profiler_project"


def _expected_in(folder: Path) -> set[tuple[str, int, str]]:
    out = set()
    for f in folder.rglob("*.py"):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            m = re.search(r"#\s*expect:\s*(AMP\d{3})", line)
            if m:
                out.add((f.name, n, m.group(1)))
    return out


def test_project_mode_follows_imports_and_calls() -> None:
    """Scaler wrapper, autocast factory and loss helper live in a package; the script that uses
    them is judged with what they are (and the model code with the script's float16)."""
    report = sc.check_paths([PROJECT])
    assert not report.errors
    found = {(Path(f.path).name, f.line, f.rule_id) for f in report.findings}
    assert found == _expected_in(PROJECT)
    assert not any(f.rule_id == "AMP008" for f in report.findings)  # the wrapper scales the loss


def test_precision_decided_outside_the_scan_is_not_guessed() -> None:
    alone = sc.check_paths([PROJECT / "train.py"])
    assert alone.findings == []  # autocast_for / lm_loss unknown: nothing is claimed
    with_context = sc.check_paths([PROJECT / "train.py"], context=[PROJECT])
    assert [(f.line, f.rule_id) for f in with_context.findings] == [(14, "AMP003")]
    assert with_context.files_checked == 1


def test_context_flag_on_the_command_line() -> None:
    out = subprocess.run([sys.executable, "-m", "training_profiler.amp_checker.checker",
                          str(PROJECT / "train.py"), "--context", str(PROJECT), "--format", "line"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout.strip().endswith("AMP003 loss `lm_loss(...)` computed outside the autocast block")


def test_bad_python_files_are_one_line_each_and_the_scan_goes_on(tmp_path: Path) -> None:
    (tmp_path / "binary.py").write_bytes(b"x = 1\0\0\n")
    (tmp_path / "latin.py").write_bytes(b'x = "\xe9"\n')
    (tmp_path / "broken.py").symlink_to(tmp_path / "missing" / "x.py")
    (tmp_path / "ok.py").write_text("import torch\nwith torch.autocast('cpu'):\n    y = torch.ones(2).half()\n"
                                    "y.float().sum().backward()\n")
    r = _cli(str(tmp_path), "--format", "line")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "binary.py:0:0: E999 a binary file, not Python source" in r.stdout
    assert "latin.py:0:0: E999 not UTF-8 text" in r.stdout
    assert "broken.py:0:0: E999 cannot read: No such file or directory" in r.stdout
    assert "ok.py:3:9: AMP001" in r.stdout
    assert len([x for x in r.stderr.splitlines() if x.startswith("amp-static-check: skipped")]) == 3


def test_rotary_einsum_outer_product_is_not_lowered_by_autocast() -> None:
    """einsum with no summed index is a broadcast multiply, which autocast leaves in float32
    (checked on CPU autocast: `einsum("i,j->ij")` stays float32, `a[:, None] @ b[None]` does not);
    a contracting einsum or a matmul of positions and frequencies is lowered and reported."""
    import torch
    pos, freq = torch.arange(8).float(), torch.rand(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.einsum("i,j->ij", pos, freq).dtype == torch.float32
        assert (pos[:, None] @ freq[None, :]).dtype == torch.bfloat16
    template = ("import torch\n"
                "def rope(positions, inv_freq):\n"
                "    with torch.autocast('cuda', dtype=torch.bfloat16):\n"
                "        return {expr}\n")
    def rules(expr: str) -> list[str]:
        return [f.rule_id for f in sc.check_source(template.format(expr=expr))[0]]
    assert "AMP020" not in rules("torch.einsum('i , j -> i j', positions, inv_freq)")
    assert "AMP020" in rules("torch.einsum('bi,ij->bj', positions, inv_freq)")
    assert "AMP020" in rules("positions[:, None] @ inv_freq[None, :]")


_PRECISION_MODULE = '''
import contextlib
import torch


@contextlib.contextmanager
def precision_context(precision):
    if precision == "fp16":
        with torch.autocast("cuda", dtype=torch.float16):
            yield
    elif precision == "bf16":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yield
    else:
        yield
'''

_TRAIN_MODULE = '''
import torch
from precision import precision_context


def train(model, opt, batches, precision):
    scaler = torch.amp.GradScaler("cuda")
    for x in batches:
        with precision_context(precision):
            loss = model(x).float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
'''


def test_a_context_with_several_autocasts_is_judged_the_same_whatever_the_hash_seed(tmp_path) -> None:
    """A context manager (in another module) that yields under float16 autocast on one branch
    and bfloat16 on another opens a run-time choice: not "every autocast in bfloat16" (AMP015).
    Which of its values a set yielded first used to decide, so composer's trainer got AMP015 or
    not with PYTHONHASHSEED."""
    (tmp_path / "precision.py").write_text(_PRECISION_MODULE)
    (tmp_path / "train.py").write_text(_TRAIN_MODULE)
    code = ("from training_profiler.amp_checker import checker as sc\n"
            f"print(sorted((f.path[-8:], f.rule_id) for f in sc.check_paths([{str(tmp_path)!r}]).findings))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(8)}
    assert len(outs) == 1 and "AMP015" not in outs.pop()
