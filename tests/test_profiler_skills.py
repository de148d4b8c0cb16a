"""Every skills/ case script is detected by the profiler tool its docstring names."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import training_profiler.skills.numerical_issues as cases
from training_profiler.amp_checker.checker import check_paths

CASE_DIR = Path(cases.__file__).parent
SKILLS = CASE_DIR.parent


def _mod(name: str):
    return importlib.import_module(f"training_profiler.skills.numerical_issues.{name}")


def check_dim_imbalance() -> None:
    r = _mod("case_dim_imbalance").run()
    assert r["risk_level"] == "HIGH" and "Dimension 1" in r["suggestion"]
    assert r["fraction_of_rows_where_bf16_sum_drops_dim1"] == 1.0


def check_nan_inf() -> None:
    mod = _mod("case_nan_inf")
    mon = mod.run()
    bad = mod.BAD_STEP + 1  # steps are counted from 1
    found = {(a["step"], a["metric"], a["layer"]) for a in mon.alerts}
    assert (bad, "loss_nonfinite", None) in found
    assert (bad, "act_nonfinite", "0") in found
    assert not any(a["step"] < bad for a in mon.alerts)


def check_fp16_grad_underflow() -> None:
    assert _mod("case_fp16_grad_underflow").run() > 0.5


def check_masked_softmax_fp16() -> None:
    r = _mod("case_masked_softmax_fp16").run()
    assert "overflow" in r["fp16_masked_fill_error"]
    assert r["nan_in_fully_masked_row"] and r["finfo_min_mask_is_finite"]


def check_outlier_saturation() -> None:
    mod = _mod("case_outlier_saturation")
    assert mod.run().first_jump == mod.OUTLIER_LAYER


RUNTIME = {"case_dim_imbalance": check_dim_imbalance, "case_nan_inf": check_nan_inf,
           "case_fp16_grad_underflow": check_fp16_grad_underflow,
           "case_masked_softmax_fp16": check_masked_softmax_fp16,
           "case_outlier_saturation": check_outlier_saturation}
STATIC = {"case_fp16_grad_underflow": {"AMP008"},
          "case_masked_softmax_fp16": {"AMP011", "AMP004", "AMP008"}}


def test_every_case_has_a_detector() -> None:
    names = {p.stem for p in CASE_DIR.glob("case_*.py")}
    assert names == set(RUNTIME) and len(names) >= 5


@pytest.mark.parametrize("name", sorted(RUNTIME))
def test_case_detected_at_run_time(name: str) -> None:
    RUNTIME[name]()


def test_static_checker_finds_the_written_mistakes() -> None:
    report = check_paths([CASE_DIR])
    found: dict[str, set[str]] = {}
    for f in report.findings:
        found.setdefault(Path(f.path).stem, set()).add(f.rule_id)
    assert found == STATIC


def test_readmes_exist_and_name_the_cases() -> None:
    for topic in ("unsafe_ops", "numerical_issues", "reduction_patterns", "common_fixes"):
        assert (SKILLS / topic / "README.md").stat().st_size > 500
    text = (SKILLS / "numerical_issues" / "README.md").read_text()
    assert all(f"{name}.py" in text for name in RUNTIME)
    rules_text = (SKILLS / "unsafe_ops" / "README.md").read_text()
    from training_profiler.amp_checker.catalog import RULES
    assert all(r.id in rules_text for r in RULES)
