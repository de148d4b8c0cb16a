"""Property tests (hypothesis): idempotence, odd symmetry, monotonicity, value sets, error bound,
rounding modes and stochastic rounding."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quant

ELEM = ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "int8", "hifp8"]
ROUND_NEAREST = ["nearest_even", "nearest_away"]

floats32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
vectors = st.lists(floats32, min_size=1, max_size=64)
SET = settings(max_examples=60, deadline=None)


def _t(v):
    return torch.tensor(v, dtype=torch.float32)


@SET
@given(v=vectors, name=st.sampled_from(ELEM + ["mxfp8", "mxfp4", "nvfp4", "mxint8", "bf16"]),
       rounding=st.sampled_from(["nearest_even", "nearest_away", "toward_zero"]))
def test_idempotent(v, name, rounding):
    x = _t(v)
    y = quant.quantize(x, name, rounding=rounding)
    if name == "nvfp4":  # the per-tensor scale moves with amax: not a projection; skip
        return
    assert torch.equal(quant.quantize(y, name, rounding=rounding), y)


@SET
@given(v=vectors, name=st.sampled_from(ELEM + ["mxfp8", "mxfp6_e2m3", "nvfp4", "fp16"]),
       rounding=st.sampled_from(["nearest_even", "nearest_away", "toward_zero"]))
def test_odd_symmetry(v, name, rounding):
    x = _t(v)
    assert torch.equal(quant.quantize(-x, name, rounding=rounding),
                       -quant.quantize(x, name, rounding=rounding))


@SET
@given(v=vectors, name=st.sampled_from(ELEM), rounding=st.sampled_from(
    ["nearest_even", "nearest_away", "toward_zero"]))
def test_monotone(v, name, rounding):
    x = torch.sort(_t(v)).values
    y = quant.quantize(x, name, rounding=rounding)
    assert (y[1:] >= y[:-1]).all()


@pytest.mark.parametrize("name", ELEM)
def test_outputs_in_value_set(name):
    vals = set(quant.get_format(name).value_set())
    g = torch.Generator().manual_seed(1)
    spec = quant.get_format(name)
    x = torch.cat([torch.randn(20000, generator=g) * spec.max_normal / 4,
                   torch.randn(20000, generator=g) * spec.min_normal,
                   torch.randn(2000, generator=g) * spec.max_normal * 3])
    for rounding in ("nearest_even", "nearest_away", "toward_zero", "stochastic"):
        y = quant.quantize(x, name, rounding=rounding, generator=g)
        assert set(y.unique().tolist()) <= vals, rounding


@pytest.mark.parametrize("name", ["mxfp8", "mxfp6_e3m2", "mxfp4", "mxint8"])
def test_mx_outputs_are_element_times_scale(name):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 32, generator=g) * torch.exp2(torch.randint(-20, 20, (40, 1),
                                                                     generator=g).float())
    y = quant.quantize(x, name)
    amax = x.abs().amax(dim=1, keepdim=True)
    s = torch.floor(torch.log2(amax)).int() - quant.get_format(name).emax  # safe: no edge
    elems = (y * torch.exp2(-s.float())).reshape(-1).tolist()
    assert set(elems) <= set(quant.get_format(name).value_set())


def _neighbours(vals, y):
    """Distance between the representable neighbours around y (the local step)."""
    arr = np.array(vals)
    i = np.searchsorted(arr, y)
    lo = arr[max(i - 1, 0)]
    hi = arr[min(i + 1, len(arr) - 1)]
    return lo, hi


@SET
@given(v=st.lists(floats32, min_size=1, max_size=32), name=st.sampled_from(ELEM),
       rounding=st.sampled_from(ROUND_NEAREST))
def test_error_at_most_half_step(v, name, rounding):
    spec = quant.get_format(name)
    x = _t(v)
    y = quant.quantize(x, name, rounding=rounding)
    vals = spec.value_set()
    for xi, yi in zip(x.tolist(), y.tolist()):
        if abs(xi) > spec.max_normal:
            assert abs(yi) == spec.max_normal
            continue
        # the two grid points bracketing x: error is at most half their distance
        arr = np.array(vals)
        j = np.searchsorted(arr, xi)
        lo, hi = arr[max(j - 1, 0)], arr[min(j, len(arr) - 1)]
        assert abs(yi - xi) <= (hi - lo) / 2 + 0.0, (xi, yi, lo, hi)
        assert yi in (lo, hi) or xi in vals


def test_rounding_modes_on_known_points():
    # fp8_e4m3 around 1: step 1/8. 1.0625 is a tie, 1.07 above it, -1.0625 negative tie
    x = _t([1.0625, 1.1875, 1.07, -1.0625, -1.07])
    ex = {"nearest_even": [1.0, 1.25, 1.125, -1.0, -1.125],
          "nearest_away": [1.125, 1.25, 1.125, -1.125, -1.125],
          "toward_zero": [1.0, 1.125, 1.0, -1.0, -1.0]}
    for mode, want in ex.items():
        assert quant.quantize(x, "fp8_e4m3", rounding=mode).tolist() == want, mode


def test_stochastic_is_seeded_and_unbiased():
    x = torch.full((200000,), 1.03)   # between 1.0 and 1.125 (fp8_e4m3), 24 % of the way up
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    y1 = quant.quantize(x, "fp8_e4m3", rounding="stochastic", generator=g1)
    y2 = quant.quantize(x, "fp8_e4m3", rounding="stochastic", generator=g2)
    assert torch.equal(y1, y2)
    assert set(y1.unique().tolist()) == {1.0, 1.125}
    assert float(y1.mean()) == pytest.approx(1.03, abs=2e-3)
    y3 = quant.quantize(x, "fp8_e4m3", rounding="stochastic",
                        generator=torch.Generator().manual_seed(1))
    assert not torch.equal(y1, y3)
    # exact grid points never move
    g = torch.Generator().manual_seed(3)
    grid = _t(quant.get_format("fp8_e4m3").value_set())
    assert torch.equal(quant.quantize(grid, "fp8_e4m3", rounding="stochastic", generator=g),
                       grid)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8_e4m3_tensor"])
def test_stochastic_scaled_formats_unbiased(name):
    g = torch.Generator().manual_seed(8)
    x = torch.rand(64, 32, generator=g) + 0.5
    acc = torch.zeros_like(x)
    n = 200
    for _ in range(n):
        acc += quant.quantize(x, name, rounding="stochastic", generator=g)
    nearest = quant.quantize(x, name)
    assert (acc / n - x).abs().mean() < (nearest - x).abs().mean() / 3


def test_bf16_rounding_modes_use_bf16_grid():
    x = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -9, 2.0 ** -130 + 2.0 ** -135])
    assert quant.quantize(x, "bf16").tolist() == x.bfloat16().float().tolist()
    tz = quant.quantize(x, "bf16", rounding="toward_zero")
    assert tz.tolist() == [1.0, 1.0, 2.0 ** -130]
    assert math.isinf(quant.quantize(torch.tensor([3.4e38]), "bf16", saturate=False).item())


def test_hifp8_hybrid_rounding():
    g = torch.Generator().manual_seed(5)
    small = torch.rand(5000, generator=g) * 7.8 + 0.13  # |E| <= 3: ties away, deterministic
    assert torch.equal(quant.quantize(small, "hifp8", rounding="hybrid", generator=g),
                       quant.quantize(small, "hifp8", rounding="nearest_away"))
    big = torch.full((100000,), 17.0)  # E=4, 2 mantissa bits: grid 16, 20 -> 17 is 25 % up
    y = quant.quantize(big, "hifp8", rounding="hybrid", generator=g)
    assert set(y.unique().tolist()) == {16.0, 20.0}
    assert float(y.mean()) == pytest.approx(17.0, abs=0.02)
    with pytest.raises(ValueError, match="hifp8 only"):
        quant.quantize(big, "fp8_e4m3", rounding="hybrid")
