"""Capture statistics on every path (the C kernel of CPU tensors, the torch host path, the
sync-free device path): exact counts, thresholds from quant's table, the log2 histogram."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from error_bounds import mean_error_bound, std_error_bound
from hypothesis import example, given, settings
from hypothesis import strategies as st

from quant import cbuild
from tensor_capture import stats
from tensor_capture.stats import RangeSpec

#: compute()'s paths for a CPU tensor: the C kernel (the default where it builds), torch's host
#: path, the device path
PATHS = {"c_kernel": {"c_kernel": True}, "torch_host": {"c_kernel": False},
         "device": {"host_path": False}}


@pytest.fixture(params=list(PATHS))
def path(request):
    if request.param == "c_kernel" and cbuild.compiler() is None:
        pytest.skip("no C compiler here: CPU statistics keep the torch host path")
    return PATHS[request.param]

E4M3 = stats.format_range("fp8_e4m3")   # quant.analysis.cast_limits: overflow above 464, flush <= 2^-10


def _brute(x: np.ndarray, spec: RangeSpec) -> dict:
    """quant.analysis' definitions in numpy: overflow = +-Inf or |x| beyond overflow_from (or at
    it when the tie rounds up); flush = 0 < |x| below flush_to (or at it when the tie flushes)."""
    f = x[np.isfinite(x)]
    a = np.abs(f)
    beyond = (a > spec.overflow_from) | ((a == spec.overflow_from) & spec.overflow_inclusive)
    flushed = (a < spec.flush_to) | ((a == spec.flush_to) & spec.flush_inclusive)
    return {
        "upper_overflow_count": int((beyond & (f > 0)).sum() + (x == np.inf).sum()),
        "lower_overflow_count": int((beyond & (f < 0)).sum() + (x == -np.inf).sum()),
        "underflow_count": int(((a > 0) & (a < spec.min_normal)).sum()),
        "flush_to_zero_count": int(((a > 0) & flushed).sum()),
    }


def test_counts_on_the_boundaries(path):
    x = torch.tensor([0.0, -0.0, -500.0, 448.0, 449.0, -448.0, 2 ** -7, 2 ** -11, -2 ** -10,
                      float("nan"), float("inf"), -float("inf"), 1.0, 3.0])
    s = stats.decode(stats.compute(x, [E4M3], **path), [E4M3])
    assert (s["numel"], s["zero_count"], s["nan_count"], s["inf_count"]) == (14, 2, 1, 2)
    assert (s["min"], s["max"], s["absmax"]) == (-500.0, 449.0, 500.0)
    assert s["min_nonzero_abs"] == 2 ** -11
    r = s["range"]["fp8_e4m3"]
    # 449 rounds to 448 (no overflow); -500 and +-Inf overflow; -2^-10 is the tie that flushes
    assert (r["upper_overflow_count"], r["lower_overflow_count"], r["overflow_count"]) == (1, 2, 3)
    assert (r["underflow_count"], r["flush_to_zero_count"]) == (3, 2)
    assert r["overflow_ratio"] == 3 / 14
    finite = x[torch.isfinite(x)].double()
    assert abs(s["mean"] - finite.mean().item()) <= mean_error_bound(finite) + mean_error_bound(
        finite, torch.float64)
    assert abs(s["std"] - finite.std().item()) <= std_error_bound(finite)


@example(values=[0.0, 1.7014118346046923e38], dtype=torch.float32, path="torch_host")
@example(values=[0.0, 1.7014118346046923e38, -3.0e38, 1e-45], dtype=torch.float32,
         path="c_kernel")
@settings(max_examples=90, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=200),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       st.sampled_from(list(PATHS)))
def test_matches_brute_force(values, dtype, path):
    """Every path (the C kernel, torch's host path, the sync-free device path) against numpy."""
    if path == "c_kernel" and cbuild.compiler() is None:
        path = "torch_host"
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    xs = x.double().numpy()
    specs = [E4M3, stats.dtype_range(dtype), stats.format_range("fp16"),
             RangeSpec("odd", 300.0, 0.003, 0.0001, overflow_from=300.0, flush_to=0.00005)]
    s = stats.decode(stats.compute(x, specs, **PATHS[path]), specs)
    for spec in specs:
        got = {k: s["range"][spec.name][k] for k in _brute(xs, spec)}
        assert got == _brute(xs, spec), spec.name
    fin = xs[np.isfinite(xs)]
    assert s["nan_count"] == int(np.isnan(xs).sum())
    assert s["inf_count"] == int(np.isinf(xs).sum())
    assert s["zero_count"] == int((xs == 0).sum())
    nz = np.abs(fin[fin != 0])
    assert sum(s["log2_hist"]["counts"]) == nz.size
    if nz.size:
        exps = np.floor(np.log2(nz)).astype(int)
        e0 = s["log2_hist"]["min_exp"]
        counts = np.bincount(exps - e0, minlength=len(s["log2_hist"]["counts"]))
        assert counts.tolist() == s["log2_hist"]["counts"]
        assert s["min_nonzero_abs"] == nz.min()
        assert s["min"] == fin.min() and s["max"] == fin.max()
    if fin.size > 1 and np.abs(fin).max() < 1e30:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        f = torch.from_numpy(fin)
        assert abs(s["mean"] - fin.mean()) <= mean_error_bound(f, acc) + mean_error_bound(
            f, torch.float64)
        assert abs(s["std"] - fin.std(ddof=1)) <= std_error_bound(f, acc)


def test_dtype_thresholds_come_from_quant_table():
    import quant

    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        r = stats.dtype_range(dtype)
        spec = quant.get_format(name)
        assert (r.max_normal, r.min_normal, r.min_subnormal) == (
            spec.max_normal, spec.min_normal, spec.min_subnormal)
    assert stats.dtype_range(torch.float64).max_normal == torch.finfo(torch.float64).max
    assert stats.format_range("fp8_e4m3").max_normal == 448.0
    assert stats.format_range("mxfp8") is None and stats.is_scaled("mxfp8")


def test_float16_subnormal_threshold_against_its_own_dtype():
    # fp16 min_subnormal/2 = 2^-25: the one value a float16 tensor can hold below it is 0
    x = torch.tensor([2 ** -24, 2 ** -15, 1.0, 65504.0], dtype=torch.float16)
    r = stats.tensor_stats(x, [stats.dtype_range(torch.float16)])["range"]["float16"]
    assert r["underflow_count"] == 2 and r["flush_to_zero_count"] == 0 and r["overflow_count"] == 0


def test_empty_noncontiguous_and_all_nan():
    assert stats.tensor_stats(torch.empty(0, 3), [E4M3])["numel"] == 0
    base = torch.randn(8, 6)
    t = base.t()[::2]
    assert not t.is_contiguous()
    s = stats.tensor_stats(t)
    assert s["numel"] == t.numel() and s["max"] == t.max().item()
    n = stats.tensor_stats(torch.full((4,), float("nan")), [E4M3])
    assert n["nan_count"] == 4 and n["min"] is None and n["absmax"] is None


def test_float64_and_subnormals(path):
    x = torch.tensor([1e-300, 1e300, -1e-310], dtype=torch.float64)
    spec = [stats.dtype_range(torch.float64)]
    s = stats.decode(stats.compute(x, spec, **path), spec)
    assert s["min_nonzero_abs"] == 1e-310
    assert s["range"]["float64"]["underflow_count"] == 1
    assert s["log2_hist"]["min_exp"] == math.floor(math.log2(1e-310))
    f = torch.tensor([2.0 ** -149, 3 * 2.0 ** -140, 0.0, 2.0 ** 127])      # float32 subnormals
    h = stats.decode(stats.compute(f, **path))["log2_hist"]
    assert h["min_exp"] == -149 and h["counts"][-140 + 1 + 149] == 1 and sum(h["counts"]) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compute_returns_one_vector_on_the_device(dtype):
    v = stats.compute(torch.randn(5, 7, dtype=dtype), [E4M3])
    assert v.dtype == torch.float64 and v.dim() == 1
