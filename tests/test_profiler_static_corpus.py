"""Precision and recall of the static checker on labelled, realistic training scripts."""
from __future__ import annotations

import re
from pathlib import Path

from training_profiler.amp_checker.checker import check_paths

CORPUS = Path(__file__).parent / "profiler_corpus"
_EXPECT = re.compile(r"#\s*expect:\s*([A-Z0-9, ]+)")

PRECISION_FLOOR = 0.9
RECALL_FLOOR = 0.8


def _labels() -> set[tuple[str, int, str]]:
    out = set()
    for f in sorted(CORPUS.glob("*.py")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            m = _EXPECT.search(line)
            if m:
                out |= {(f.name, n, r.strip()) for r in m.group(1).split(",") if r.strip()}
    return out


def corpus_scores() -> tuple[float, float, int, int, int]:
    expected = _labels()
    report = check_paths([CORPUS])
    assert not report.errors
    found = {(Path(f.path).name, f.line, f.rule_id) for f in report.findings}
    tp = len(found & expected)
    precision = tp / len(found) if found else 0.0
    recall = tp / len(expected)
    return precision, recall, tp, len(found), len(expected)


def test_corpus_precision_and_recall() -> None:
    precision, recall, tp, n_found, n_expected = corpus_scores()
    print(f"\nstatic checker corpus: precision {precision:.3f} ({tp}/{n_found}), "
          f"recall {recall:.3f} ({tp}/{n_expected})")
    assert n_expected >= 15 and len(list(CORPUS.glob("*.py"))) >= 8
    assert precision >= PRECISION_FLOOR
    assert recall >= RECALL_FLOOR


def test_clean_script_has_no_findings() -> None:
    assert check_paths([CORPUS / "clean_bf16_llama.py"]).findings == []
