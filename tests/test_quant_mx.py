"""MX / NVFP4 / per-tensor scaled formats against slow independent numpy references."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import quant

MX_ELEM = {"mxfp8": ml_dtypes.float8_e4m3fn, "mxfp8_e5m2": ml_dtypes.float8_e5m2,
           "mxfp6_e3m2": ml_dtypes.float6_e3m2fn, "mxfp6_e2m3": ml_dtypes.float6_e2m3fn,
           "mxfp4": ml_dtypes.float4_e2m1fn, "mxint8": None}


def _elem_cast(v: np.ndarray, name: str) -> np.ndarray:
    spec = quant.get_format(name)
    v = np.clip(v, -spec.max_normal, spec.max_normal).astype(np.float32)
    if MX_ELEM[name] is None:  # MX INT8: round-half-even on the 2^-6 grid (np.round is RNE)
        return (np.round(v * 64) / 64).astype(np.float32)
    return v.astype(MX_ELEM[name]).astype(np.float32)


def _mx_reference(x: np.ndarray, name: str, block: int = 32, mode: str = "floor") -> np.ndarray:
    """Block by block with Python ints and math.frexp: exact shared exponents."""
    spec = quant.get_format(name)
    rows, n = x.shape
    out = np.empty_like(x)
    for r in range(rows):
        for b0 in range(0, n, block):
            blk = x[r, b0:b0 + block]
            amax = float(np.max(np.abs(blk)))
            if not math.isfinite(amax):
                out[r, b0:b0 + block] = np.nan
                continue
            if amax == 0:
                s = -127
            else:
                m, e = math.frexp(amax)          # amax = m * 2^e, m in [0.5, 1)
                floor_log2 = e - 1
                ceil_log2 = floor_log2 if m == 0.5 else e
                if mode == "floor":
                    s = floor_log2 - spec.emax
                elif mode == "ceil":
                    s = ceil_log2 - spec.emax
                else:  # rceil: smallest s with amax <= max_normal * 2^s
                    s = math.ceil(math.log2(amax / spec.max_normal)) - 2
                    while amax > spec.max_normal * 2.0 ** s:
                        s += 1
            s = max(-127, min(127, s))
            v = (blk.astype(np.float64) / 2.0 ** s).astype(np.float32)
            with np.errstate(over="ignore"):  # ceil near float32 max: 6 * 2^126 is Inf
                out[r, b0:b0 + block] = (_elem_cast(v, name).astype(np.float64) * 2.0 ** s)
    return out


def _data(seed=0, rows=6, n=256):
    """Blocks at very different magnitudes, including ones that hit both E8M0 clamps."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((rows, n)).astype(np.float32)
    mags = 2.0 ** g.integers(-140, 125, size=(rows, n // 32, 1))
    x = (x.reshape(rows, n // 32, 32) * mags).reshape(rows, n).astype(np.float32)
    x[0, :32] = 0.0                                  # all-zero block
    x[0, 32:64] = 1e-3
    x[0, 40] = 3e4                                    # one huge value in a block
    x[1, :32] = 2.0 ** -140                           # float32 subnormals: scale clamps low
    x[1, 32:64] = np.float32(3.0e38)                  # near float32 max: high exponents
    x[2, :32] = np.nextafter(np.float32(2.0 ** 7), np.float32(0))  # amax just below 2^k
    return x


@pytest.mark.parametrize("name", list(MX_ELEM))
@pytest.mark.parametrize("mode", ["floor", "ceil", "rceil"])
def test_mx_matches_reference(name, mode):
    x = _data(seed=len(name))
    y = quant.quantize(torch.from_numpy(x), name, scale_mode=mode).numpy()
    ref = _mx_reference(x, name, mode=mode)
    assert np.array_equal(y.view(np.uint32), ref.view(np.uint32)), (
        np.argwhere(y.view(np.uint32) != ref.view(np.uint32))[:5])


def test_mx_zero_block_and_huge_value():
    x = torch.zeros(2, 32)
    x[1] = 1e-3
    x[1, 5] = 3e4
    y = quant.quantize(x, "mxfp8")
    assert torch.equal(y[0], torch.zeros(32))
    assert y[1, 5] == 28672.0   # 3e4 -> scale 2^(14-8): 3e4/64 = 468.75 saturates to 448
    assert (y[1, torch.arange(32) != 5] == 0).all()  # 1e-3/64 is below E4M3's 2^-9: flushed


def test_mx_scale_clamps_both_ends():
    tiny = torch.full((32,), 2.0 ** -140)      # floor(log2) - 8 = -148 -> clamped to -127
    y = quant.quantize(tiny, "mxfp8")
    # with scale 2^-127 the elements are 2^-13, below E4M3's 2^-9 subnormal: flush to zero
    assert torch.equal(y, torch.zeros(32))
    small = torch.full((32,), 2.0 ** -133)     # element 2^-6 = min normal after clamping
    assert torch.equal(quant.quantize(small, "mxfp8"), small)
    big = torch.full((32,), 2.0 ** 127)        # mxint8: emax 0 -> scale 2^127 (top of E8M0)
    assert torch.equal(quant.quantize(big, "mxint8"), big)


def test_mx_padding_equals_zero_padded_blocks():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 45, generator=g)
    padded = torch.cat([x, torch.zeros(3, 19)], dim=1)
    for name in ("mxfp8", "mxfp4", "nvfp4"):
        assert torch.equal(quant.quantize(x, name), quant.quantize(padded, name)[:, :45])


def test_mx_axis_and_block_size():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 8, generator=g)
    y0 = quant.quantize(x, "mxfp8", axis=0)
    assert torch.equal(y0, quant.quantize(x.t().contiguous(), "mxfp8").t())
    y16 = quant.quantize(x.reshape(-1), "mxfp4", block_size=16)
    ref = torch.from_numpy(_mx_reference(x.reshape(1, -1).numpy(), "mxfp4", block=16))
    assert torch.equal(y16, ref.reshape(-1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "mxint8", "nvfp4"])
def test_nan_inf_poisons_only_its_block(bad, name):
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    x[0, 3] = bad
    y = quant.quantize(x, name)
    blk = quant.get_format(name).block_size
    assert y[0, :blk].isnan().all()
    assert torch.isfinite(y[0, blk:]).all() and torch.isfinite(y[1]).all()
    clean = x.clone()
    clean[0, :blk] = 0
    if name != "nvfp4":  # nvfp4's tensor scale ignores non-finite values: same scale
        assert torch.equal(y[0, blk:], quant.quantize(clean, name)[0, blk:])


def _e4m3(v):
    return np.clip(v, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(
        np.float32)


def _nvfp4_reference(x: np.ndarray) -> np.ndarray:
    f32 = np.float32
    fin = np.abs(x[np.isfinite(x)])
    amax = f32(fin.max()) if fin.size else f32(0)
    s_t = amax / f32(6 * 448) if amax > 0 else f32(1)
    out = np.empty_like(x)
    flat, o = x.reshape(-1, 16), out.reshape(-1, 16)
    for i, blk in enumerate(flat):
        ab = f32(np.max(np.abs(blk)))
        if not np.isfinite(ab):
            o[i] = np.nan
            continue
        raw = np.clip(f32(ab / f32(6)) / s_t, f32(2.0 ** -9), f32(448))
        s_b = _e4m3(np.array([raw], np.float32))[0]
        denom = f32(s_b * s_t)
        v = (blk / denom).astype(np.float32)
        q = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
        o[i] = q * denom
    return out


def test_nvfp4_matches_reference():
    x = _data(seed=9, rows=4, n=128)
    x[3] *= 1e-6  # blocks far below the tensor amax: block scale clamps to 2^-9
    y = quant.quantize(torch.from_numpy(x), "nvfp4").numpy()
    ref = _nvfp4_reference(x)
    assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))


def test_nvfp4_all_zero_tensor():
    assert torch.equal(quant.quantize(torch.zeros(40), "nvfp4"), torch.zeros(40))


@pytest.mark.parametrize("name,maxn,dt", [("fp8_e4m3_tensor", 448.0, ml_dtypes.float8_e4m3fn),
                                          ("fp8_e5m2_tensor", 57344.0, ml_dtypes.float8_e5m2)])
def test_tensor_scaled_matches_reference(name, maxn, dt):
    g = np.random.default_rng(3)
    x = (g.standard_normal(5000) * 1e-3).astype(np.float32)
    x[7] = np.inf  # ignored by the amax; saturates
    fin = np.abs(x[np.isfinite(x)]).max()
    scale = np.float32(maxn) / np.float32(fin)
    v = np.clip(x * scale, -maxn, maxn).astype(np.float32)
    ref = v.astype(dt).astype(np.float32) * (np.float32(1) / scale)
    y = quant.quantize(torch.from_numpy(x), name).numpy()
    assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))
    assert float(np.abs(y[np.isfinite(y)]).max()) == pytest.approx(float(fin), rel=1e-6)
    assert torch.equal(quant.quantize(torch.zeros(9), name), torch.zeros(9))


def test_nvfp4_float32_subnormal_tensor_flushes_cleanly():
    x = torch.full((32,), 1e-44)
    x[0] = 3e-44
    y = quant.quantize(x, "nvfp4")
    assert torch.equal(y, torch.zeros(32))
    r = quant.analyze_quantization(x, "nvfp4")
    assert r.flush_to_zero_count == 32 and r.nan_count == 0
