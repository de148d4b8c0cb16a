"""analyze_quantization: counts, ratios, per-block results, warnings, opt-in on quantize."""
import pytest
import torch

import quant
from quant.analysis import severity, warn_if_underflow


def _known():
    # fp8_e4m3: min_subnormal 2^-9 (flush below 2^-10), min_normal 2^-6, max 448
    return torch.tensor([1.0] * 90 + [1e-4] * 5 + [0.01] * 3 + [500.0] * 2)


def test_counts_and_ratios():
    r = quant.analyze_quantization(_known(), "fp8_e4m3")
    assert (r.total, r.nonzero) == (100, 100)
    assert (r.overflow_count, r.underflow_count, r.flush_to_zero_count) == (2, 8, 5)
    assert r.flush_to_zero_ratio == pytest.approx(0.05)
    assert (r.underflow_severity, r.overflow_severity) == ("high", "high")
    assert r.range_before == (pytest.approx(1e-4), 500.0)
    assert r.range_after == (0.0, 448.0)
    assert r.absmax_after == 448.0 and r.min_nonzero_before == pytest.approx(1e-4)
    assert r.per_block is None
    d = r.to_dict()
    assert d["flush_to_zero_count"] == 5 and "per_block" not in d


def test_severity_thresholds():
    assert severity(0.02) == "high" and severity(0.005) == "medium"
    assert severity(0.001) == "none" and severity(0.0) == "none"


def test_nan_inf_and_zero_inputs():
    x = torch.tensor([0.0, float("nan"), float("inf"), -float("inf"), 1.0])
    r = quant.analyze_quantization(x, "fp8_e5m2")
    assert (r.nan_count, r.inf_count, r.overflow_count, r.nonzero) == (1, 2, 2, 1)
    assert r.flush_to_zero_count == 0 and r.range_before == (0.0, 1.0)


def test_per_block_mx():
    x = torch.ones(2, 64)
    x[0, 32:] = 1.0
    x[0, 40] = 2.0 ** 20   # scale 2^12: ones become 2^-12 < 2^-10: flushed (31 of them)
    x[1, 5] = float("nan")
    r = quant.analyze_quantization(x, "mxfp8")
    pb = r.per_block
    assert pb["flush_to_zero"].tolist() == [[0, 31], [0, 0]]
    assert pb["underflow"].tolist() == [[0, 31], [0, 0]]
    assert pb["scale"][0].tolist() == [2.0 ** -8, 2.0 ** 12]
    assert r.nan_blocks == 1 and r.block_size == 32
    assert r.flush_to_zero_count == 31
    assert r.to_dict(include_blocks=True)["per_block"]["flush_to_zero"] == [[0, 31], [0, 0]]


def test_block_padding_not_counted():
    x = torch.full((40,), 1e-30)
    r = quant.analyze_quantization(x, "mxfp4")
    assert r.per_block["underflow"].tolist() == [[0, 0]]  # scale tracks the block: no underflow
    assert r.total == 40 and r.flush_to_zero_count == 0


def test_scaled_formats_use_scaled_values():
    x = torch.full((100,), 1e-6)
    x[0] = 1.0
    elem = quant.analyze_quantization(x, "fp8_e4m3")
    tensor = quant.analyze_quantization(x, "fp8_e4m3_tensor")
    assert elem.flush_to_zero_count == 99
    # scale 448: 1e-6*448 = 4.5e-4 < 2^-10: still flushed; underflow counts agree
    assert tensor.flush_to_zero_count == 99 and tensor.underflow_count == 99
    r = quant.analyze_quantization(torch.full((100,), 3e-3), "fp8_e4m3_tensor")
    assert r.underflow_count == 0 and r.overflow_count == 0


def test_warning_text_and_opt_in(capsys, monkeypatch):
    x = _known()
    monkeypatch.delenv("QUANT_ANALYZE", raising=False)
    y_plain = quant.quantize(x, "fp8_e4m3")
    assert capsys.readouterr().err == ""
    y = quant.quantize(x, "fp8_e4m3", analyze=True)
    err = capsys.readouterr().err
    assert torch.equal(y, y_plain)
    assert "UNDERFLOW WARNING" in err and "Flush to Zero: 5 (5.00%)" in err
    assert "Severity: HIGH" in err and "Tensor Range: [1.00e-04, 5.00e+02]" in err
    monkeypatch.setenv("QUANT_ANALYZE", "1")
    assert torch.equal(quant.quantize(x, "fp8_e4m3"), y_plain)
    assert "Severity: HIGH" in capsys.readouterr().err
    quant.quantize(x, "fp8_e4m3", analyze=False)  # argument overrides the variable
    assert capsys.readouterr().err == ""


def test_medium_warning_and_silence_below_threshold(capsys):
    x = torch.ones(1000)
    x[:5] = 1e-5                  # 0.5 % underflow (all flushed) -> medium
    r = quant.analyze_quantization(x, "fp8_e4m3")
    assert warn_if_underflow(r) is not None
    assert r.underflow_severity == "medium"
    assert "🟡" in capsys.readouterr().err
    x = torch.ones(1000)
    x[:1] = 1e-5                  # 0.1 % exactly: not above the threshold
    assert quant.analyze_quantization(x, "fp8_e4m3").warning_message() is None
    quant.quantize(x, "fp8_e4m3", analyze=True)
    assert capsys.readouterr().err == ""


def test_quantized_argument_and_bad_input():
    x = torch.randn(64)
    y = quant.quantize(x, "mxfp4")
    a = quant.analyze_quantization(x, "mxfp4", quantized=y)
    b = quant.analyze_quantization(x, "mxfp4")
    assert a.to_dict() == b.to_dict()
    with pytest.raises(ValueError, match="shape"):
        quant.analyze_quantization(x, "mxfp4", quantized=y[:10])
    with pytest.raises(TypeError, match="analyze_quantization"):
        quant.analyze_quantization(torch.arange(4), "mxfp4")
    with pytest.raises(ValueError, match="valid formats"):
        quant.analyze_quantization(x, "fp5")


def test_bf16_input_and_scalar():
    x = torch.randn(100).bfloat16()
    r = quant.analyze_quantization(x, "hifp8")
    assert r.total == 100
    s = quant.analyze_quantization(torch.tensor(1e-9), "mxfp8")
    assert s.total == 1 and s.flush_to_zero_count == 0
