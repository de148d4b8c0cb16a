"""quant public API: format facts, option validation, shapes/dtypes, bad input, metrics."""
import math

import pytest
import torch

import quant
from quant import metrics

NAMES = ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "int8", "mxfp8",
         "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "mxint8", "nvfp4", "hifp8",
         "fp8_e4m3_tensor", "fp8_e5m2_tensor", "bf16", "fp16", "fp32"]

# (name, ebits, mbits, bias, emax, max_normal, min_normal, min_subnormal)
FACTS = [
    ("fp8_e4m3", 4, 3, 7, 8, 448.0, 2.0 ** -6, 2.0 ** -9),
    ("fp8_e5m2", 5, 2, 15, 15, 57344.0, 2.0 ** -14, 2.0 ** -16),
    ("fp6_e3m2", 3, 2, 3, 4, 28.0, 2.0 ** -2, 2.0 ** -4),
    ("fp6_e2m3", 2, 3, 1, 2, 7.5, 1.0, 2.0 ** -3),
    ("fp4_e2m1", 2, 1, 1, 2, 6.0, 1.0, 0.5),
    ("fp16", 5, 10, 15, 15, 65504.0, 2.0 ** -14, 2.0 ** -24),
    ("bf16", 8, 7, 127, 127, float(torch.finfo(torch.bfloat16).max), 2.0 ** -126, 2.0 ** -133),
]


def test_every_contract_name_present():
    assert set(NAMES) == set(quant.FORMATS)


@pytest.mark.parametrize("name,eb,mb,bias,emax,mx,mn,ms", FACTS)
def test_element_facts(name, eb, mb, bias, emax, mx, mn, ms):
    s = quant.get_format(name)
    assert (s.ebits, s.mbits, s.bias, s.emax) == (eb, mb, bias, emax)
    assert (s.max_normal, s.min_normal, s.min_subnormal) == (mx, mn, ms)


def test_block_and_special_facts():
    assert quant.get_format("mxfp8").block_size == 32
    assert quant.get_format("mxfp8").scale_format == "e8m0"
    assert quant.get_format("mxfp4").max_normal == 6.0
    assert quant.get_format("nvfp4").block_size == 16
    h = quant.get_format("hifp8")
    assert (h.max_normal, h.min_normal, h.min_subnormal) == (2.0 ** 15, 2.0 ** -15, 2.0 ** -22)
    assert h.nan_encoding == "0x80" and h.default_rounding == "nearest_away"
    assert quant.get_format("mxint8").max_normal == 127 / 64
    assert quant.get_format("  MXFP8 ") is quant.FORMATS["mxfp8"]


def test_unknown_format_lists_names():
    with pytest.raises(ValueError) as e:
        quant.get_format("fp7")
    assert "mxfp8" in str(e.value) and "hifp8" in str(e.value)
    with pytest.raises(ValueError):
        quant.quantize(torch.ones(3), "nope")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shape_dtype_preserved(name, dtype):
    x = (torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    y = quant.quantize(x, name)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    # a format with >= 2 mantissa bits keeps values within 50% of a normal-range input
    if name not in ("fp4_e2m1", "int8", "mxfp4", "nvfp4"):
        big = x.float().abs() > 0.5
        rel = ((y.float() - x.float()).abs() / x.float().abs())[big]
        assert rel.max() < 0.26


def test_fp32_is_identity_copy():
    x = torch.randn(10)
    y = quant.quantize(x, "fp32")
    assert torch.equal(x, y) and y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("bad", [torch.arange(5), torch.ones(3, dtype=torch.float64),
                                 torch.ones(2, dtype=torch.bool)])
def test_non_float_input_rejected(bad):
    with pytest.raises(TypeError, match="float32, bfloat16 and float16"):
        quant.quantize(bad, "mxfp8")


def test_bad_options_rejected():
    x = torch.ones(8)
    with pytest.raises(ValueError, match="nearest_even"):
        quant.quantize(x, "fp8_e4m3", rounding="round")
    with pytest.raises(ValueError, match="floor"):
        quant.quantize(x, "mxfp8", scale_mode="even")
    with pytest.raises(ValueError, match="only applies to MX"):
        quant.quantize(x, "fp8_e4m3", scale_mode="ceil")
    with pytest.raises(ValueError, match="block formats"):
        quant.quantize(x, "fp8_e4m3", block_size=16)
    with pytest.raises(ValueError, match="positive int"):
        quant.quantize(x, "mxfp8", block_size=0)
    with pytest.raises(ValueError, match="axis"):
        quant.quantize(x, "mxfp8", axis=3)
    with pytest.raises(TypeError):
        quant.quantize([1.0, 2.0], "mxfp8")


@pytest.mark.parametrize("name", NAMES)
def test_empty_and_scalar(name):
    e = torch.empty(0, 4)
    assert quant.quantize(e, name).shape == (0, 4)
    s = torch.tensor(3.3)
    y = quant.quantize(s, name)
    assert y.shape == () and torch.isfinite(y)


@pytest.mark.parametrize("name", ["fp8_e4m3", "mxfp8", "nvfp4", "hifp8", "mxfp4"])
def test_non_contiguous_matches_contiguous(name):
    base = torch.randn(64, 48, generator=torch.Generator().manual_seed(3))
    t = base.t()  # non-contiguous view; blocks run along its last axis
    assert not t.is_contiguous()
    assert torch.equal(quant.quantize(t, name), quant.quantize(t.contiguous(), name))


def test_requires_grad_and_ste():
    x = torch.randn(64, requires_grad=True)
    y = quant.quantize(x, "mxfp8")
    assert not y.requires_grad
    z = quant.quantize_ste(x, "mxfp8")
    z.sum().backward()
    assert torch.equal(x.grad, torch.ones(64))
    assert torch.equal(z.detach(), y)


def test_ste_forward_is_exactly_quantize_on_saturation_and_inf():
    # x + (q - x).detach() would give NaN for Inf and lose q far above max_normal.
    x = torch.tensor([float("inf"), -float("inf"), 3e38, -1e30, 1000.0, 1e-30], requires_grad=True)
    z = quant.quantize_ste(x, "fp8_e4m3")
    assert torch.equal(z.detach(), quant.quantize(x.detach(), "fp8_e4m3"))
    z.sum().backward()
    assert torch.equal(x.grad, torch.ones(6))


# ---- metrics -----------------------------------------------------------------------------

def test_metrics_values():
    a = torch.tensor([1.0, -2.0, 3.0, 4.0])
    b = torch.tensor([1.0, -2.5, 3.0, 3.0])
    assert metrics.mse(a, b) == pytest.approx((0.25 + 1.0) / 4)
    assert metrics.rmse(a, b) == pytest.approx(math.sqrt(1.25 / 4))
    assert metrics.mae(a, b) == pytest.approx(1.5 / 4)
    assert metrics.max_abs_error(a, b) == 1.0
    assert metrics.relative_error(a, b) == pytest.approx(1.5 / 10)
    cos = float(torch.dot(a, b) / (a.norm() * b.norm()))
    assert metrics.cosine_similarity(a, b) == pytest.approx(cos, rel=1e-6)
    assert metrics.psnr(a, b) == pytest.approx(10 * math.log10(16 / (1.25 / 4)), rel=1e-6)
    assert metrics.sqnr(a, b) == pytest.approx(10 * math.log10(30 / 1.25), rel=1e-6)
    d = metrics.all_metrics(a, b)
    assert set(d) == {"mse", "rmse", "mae", "max_abs_error", "relative_error",
                      "cosine_similarity", "psnr", "sqnr"}


def test_metrics_edge_cases():
    z = torch.zeros(4)
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert metrics.psnr(a, a) == math.inf and metrics.sqnr(a, a) == math.inf
    assert metrics.cosine_similarity(z, z) == 1.0 and metrics.cosine_similarity(a, z) == 0.0
    assert metrics.relative_error(z, z) == 0.0 and metrics.relative_error(z, a) == math.inf
    # bf16 inputs are evaluated in float32; large values do not overflow the cosine
    big = torch.full((8,), 3e38)
    assert metrics.cosine_similarity(big, big) == pytest.approx(1.0)
    assert metrics.mse(a.bfloat16(), a) == 0.0
    with pytest.raises(ValueError, match="element counts"):
        metrics.mse(a, torch.ones(3))
    with pytest.raises(ValueError, match="empty"):
        metrics.mse(torch.ones(0), torch.ones(0))


def test_cosine_of_identical_tensors_is_one():
    x = torch.randn(300000, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert metrics.cosine_similarity(x, x.float()) == 1.0
    assert -1.0 <= metrics.cosine_similarity(x, -x) <= -0.999999


def test_demo_runs(capsys):
    from quant_tools import demo
    assert demo.main(["--formats", "mxfp8", "hifp8", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"format": "mxfp8"' in out and '"sqnr"' in out
    assert demo.main(["--formats", "nope"]) == 2
    assert "--formats='nope' is not a known format; valid: " in capsys.readouterr().err
