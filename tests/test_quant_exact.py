"""Bit-exact element casts against independent references (ml_dtypes, en_dtypes)."""
import en_dtypes
import ml_dtypes
import numpy as np
import pytest
import torch

import quant

ML = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
      "fp6_e3m2": ml_dtypes.float6_e3m2fn, "fp6_e2m3": ml_dtypes.float6_e2m3fn,
      "fp4_e2m1": ml_dtypes.float4_e2m1fn}
N_RANDOM = 10_000_000  # per format, as the issue asks


@pytest.fixture(autouse=True)
def _eager(monkeypatch):
    """These tests pin the eager kernels (the reference semantics); test_quant_compiled.py
    checks the compiled kernels against them."""
    monkeypatch.setenv("QUANT_COMPILE", "0")


def _ref_saturating(x: np.ndarray, name: str) -> np.ndarray:
    """ml_dtypes nearest-even cast with saturation: clip first (clipping only touches values
    beyond max_normal, which is itself representable)."""
    m = quant.get_format(name).max_normal
    with np.errstate(invalid="ignore"):
        return np.clip(x, -m, m).astype(ML[name]).astype(np.float32)


def _same_bits(y: np.ndarray, ref: np.ndarray, x: np.ndarray):
    """Equal bit patterns; NaN inputs must give NaN (ml_dtypes maps NaN to -0 for NaN-less
    fp6/fp4 types; our documented policy keeps NaN)."""
    nan = np.isnan(x)
    assert np.isnan(y[nan]).all()
    bad = (y.view(np.uint32) != ref.view(np.uint32)) & ~nan
    idx = np.flatnonzero(bad)[:5]
    assert not bad.any(), f"{bad.sum()} mismatches, e.g. x={x[idx]} got={y[idx]} ref={ref[idx]}"


def _grid_and_midpoints(name: str) -> np.ndarray:
    """Every representable value, every midpoint between neighbours, and their float32
    neighbours (one ulp each side): all rounding boundaries and ties, both signs."""
    vals = np.array(quant.get_format(name).value_set(), dtype=np.float64)
    vals = vals[vals >= 0]
    mids = (vals[:-1] + vals[1:]) / 2
    s = quant.get_format(name)
    extra = [s.max_normal * 1.0625, s.max_normal * 2, 1e30, s.min_subnormal / 2,
             s.min_subnormal / 4, 3.4e38]
    pts = np.concatenate([vals, mids, extra]).astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)),
                          np.nextafter(pts, np.float32(0))])
    pts = np.concatenate([pts, -pts, np.array([np.inf, -np.inf, np.nan], np.float32)])
    return pts


@pytest.mark.parametrize("name", list(ML))
def test_boundaries_ties_subnormals(name):
    x = _grid_and_midpoints(name)
    y = quant.quantize(torch.from_numpy(x), name).numpy()
    _same_bits(y, _ref_saturating(x, name), x)


@pytest.mark.parametrize("name", list(ML))
def test_random_bit_patterns(name):
    rng = np.random.default_rng(abs(hash(name)) % 2 ** 32)
    x = rng.integers(0, 2 ** 32, size=N_RANDOM, dtype=np.uint32).view(np.float32)
    y = quant.quantize(torch.from_numpy(x), name).numpy()
    _same_bits(y, _ref_saturating(x, name), x)


@pytest.mark.parametrize("name", list(ML))
def test_non_saturating_matches_ml_dtypes(name):
    """saturate=False: E4M3 overflow -> NaN, E5M2 -> Inf, fp6/fp4 clamp (they have neither)."""
    x = _grid_and_midpoints(name)
    y = quant.quantize(torch.from_numpy(x), name, saturate=False).numpy()
    with np.errstate(invalid="ignore"):
        ref = x.astype(ML[name]).astype(np.float32)
    nan_ref = np.isnan(ref) & ~np.isnan(x)
    assert np.isnan(y[nan_ref]).all()
    keep = ~nan_ref
    _same_bits(y[keep], ref[keep], x[keep])


def _hif8_ref(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(en_dtypes.hifloat8).astype(np.float32)


def test_hifp8_matches_en_dtypes_boundaries():
    """en_dtypes rounds half away from zero (our hifp8 default) and overflows to Inf."""
    x = _grid_and_midpoints("hifp8")
    y = quant.quantize(torch.from_numpy(x), "hifp8", saturate=False).numpy()
    _same_bits(y, _hif8_ref(x), x)


def test_hifp8_matches_en_dtypes_random():
    rng = np.random.default_rng(7)
    x = rng.integers(0, 2 ** 32, size=N_RANDOM, dtype=np.uint32).view(np.float32)
    y = quant.quantize(torch.from_numpy(x), "hifp8", saturate=False).numpy()
    _same_bits(y, _hif8_ref(x), x)


def test_hifp8_saturating_clamps_to_max():
    x = torch.tensor([1.25 * 2 ** 15, 1e9, float("inf"), -float("inf"), 40959.0])
    assert quant.quantize(x, "hifp8").tolist() == [32768.0, 32768.0, 32768.0, -32768.0, 32768.0]
    y = quant.quantize(x, "hifp8", saturate=False)
    assert y[:3].isinf().all() and y[3] == -float("inf") and y[4] == 32768.0


def test_hifp8_tie_rules_differ_only_on_ties():
    # 1 + 1/16 is a tie on the 3-bit grid at E=0: away -> 1.125, even -> 1.0
    x = torch.tensor([1.0625, 1.1875, 2 ** -23, 1.5 * 2 ** -20, 1.25 * 2 ** 15])
    away = quant.quantize(x, "hifp8", rounding="nearest_away", saturate=False)
    even = quant.quantize(x, "hifp8", rounding="nearest_even", saturate=False)
    assert away.tolist() == [1.125, 1.25, 2 ** -22, 2 ** -19, float("inf")]
    assert even.tolist() == [1.0, 1.25, 0.0, 2 ** -19, 32768.0]


def test_hifp8_value_set_has_253_finite_values_and_no_negative_zero():
    vals = quant.get_format("hifp8").value_set()
    assert len(vals) == 253 and sum(v > 0 for v in vals) == 126
    assert max(vals) == 2 ** 15 and min(v for v in vals if v > 0) == 2 ** -22
    y = quant.quantize(torch.tensor([-1e-30, -0.0]), "hifp8")
    assert torch.equal(y.view(torch.int32), torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_bf16_fp16_casts_match_torch(name, dtype):
    rng = np.random.default_rng(11)
    x = torch.from_numpy(rng.integers(0, 2 ** 32, size=1_000_000, dtype=np.uint32)
                         .view(np.float32))
    y = quant.quantize(x, name, saturate=False)
    ref = x.to(dtype).float()
    nan = x.isnan()
    assert y[nan].isnan().all()
    assert torch.equal(y[~nan].view(torch.int32), ref[~nan].view(torch.int32))
    ys = quant.quantize(x, name)  # saturating: finite everywhere except NaN
    assert torch.isfinite(ys[~nan]).all()
    fin = torch.isfinite(ref) & ~nan
    assert torch.equal(ys[fin], ref[fin])
