"""quant.vocabulary: the one check of a format name ("hp" wherever a quantization is chosen), the
ordered severity scale, and CUSTOM_QUANT_TYPE=hp through the real capture path."""
from __future__ import annotations

import types

import pytest
import torch

from quant import gemm_plan
from quant.vocabulary import (
    FINDING_LEVELS,
    HIGH_PRECISION,
    HIGH_PRECISION_NAMES,
    FormatNameError,
    Severity,
    check_format_name,
    is_high_precision,
)
from tensor_capture import hooks, schema
from tensor_capture import saver as saver_mod

CAPTURE_ENV = ("TENSOR_SAVE_ENABLED", "TENSOR_SAVE_DIR", "CUSTOM_QUANT_TYPE", "CUSTOM_QUANT_PLAN",
               "TENSOR_SAVE_CONFIG", "TENSOR_SAVE_MODE", "TENSOR_SAVE_GUARD")


def test_the_format_check_folds_case_and_names_every_valid_choice():
    assert check_format_name(" MXFP8 ", "X") == "mxfp8"
    for word in HIGH_PRECISION_NAMES:
        assert check_format_name(word.upper(), "X") == HIGH_PRECISION
    assert check_format_name("fp32", "X", high_precision=False) == "fp32"   # a format to measure
    with pytest.raises(FormatNameError) as exc:
        check_format_name("hp", "--whatif", high_precision=False)
    assert str(exc.value).startswith("--whatif='hp' is not a known format; valid: fp8_e4m3, ")
    with pytest.raises(FormatNameError) as exc:
        check_format_name("fp9", "CUSTOM_QUANT_TYPE", ("mxfp8", "fp32"))
    assert str(exc.value) == ("CUSTOM_QUANT_TYPE='fp9' is not a known format; valid: mxfp8, or "
                              "hp / fp32 / none (no quantization)")
    assert is_high_precision(None) and is_high_precision(" HP ") and not is_high_precision("mxfp8")


def test_severity_is_one_ordered_scale_with_its_two_spellings():
    assert list(Severity) == sorted(Severity)
    assert Severity.NONE < Severity.LOW < Severity.MEDIUM < Severity.HIGH
    assert [s.label for s in FINDING_LEVELS] == ["LOW", "MEDIUM", "HIGH"]
    assert Severity.of("high") is Severity.of("HIGH") is Severity.HIGH
    assert Severity.parse("medium") is Severity.MEDIUM
    with pytest.raises(ValueError, match="unknown severity 'none'; use low, medium or high"):
        Severity.parse("none")           # a finding is at least LOW
    from quant.severity import SEVERITIES, severity, severity_label

    assert SEVERITIES == ("none", "medium", "high")     # quant's words, as before
    assert [severity_label(severity(r)) for r in (0.0, 0.005, 0.5)] == ["NONE", "MEDIUM", "HIGH"]


def _linear_output(monkeypatch, tmp_path, quant_type: str):
    """One fprop through the hook the patched Megatron calls, capture and emulation configured
    from the environment as in a run; returns (output, x, w, the manifest records)."""
    for var in CAPTURE_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "1")
    monkeypatch.setenv("TENSOR_SAVE_DIR", str(tmp_path))
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", quant_type)
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 64, generator=gen), torch.randn(32, 64, generator=gen)
    saver_mod.reset_tensor_saver()
    try:
        out = hooks.linear_forward(types.SimpleNamespace(), x, w, None)
        saver_mod.get_tensor_saver().close()
    finally:
        saver_mod.reset_tensor_saver()
        from tensor_capture import sites

        sites.uninstall_discovery()
    return out, x, w, list(schema.read_manifest(tmp_path))


@pytest.mark.parametrize("word", ["hp", "HP"])
def test_custom_quant_type_hp_runs_and_captures_in_high_precision(monkeypatch, tmp_path, word):
    """CUSTOM_QUANT_TYPE=hp was refused by capture's own list (it lacked hp): now it is high
    precision, as in precision plans and the TE factory: the GEMM sees its operands unchanged
    and the records name the label and no emulated format."""
    out, x, w, recs = _linear_output(monkeypatch, tmp_path / "hp", word)
    assert torch.equal(out, gemm_plan.linear_forward(x, w, None, None))
    assert recs and {schema.parse_filename(r["file"]).quant_type for r in recs} == {"hp"}
    assert all(r.get(schema.META_EMULATED_FORMAT) is None for r in recs)
    # the check can fail: a quantizing format changes the GEMM's output on the same path
    q_out, *_ = _linear_output(monkeypatch, tmp_path / "mx", "mxfp8")
    assert not torch.equal(q_out, out)
