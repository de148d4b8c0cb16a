"""The flight recorder's one-pass CPU kernel (tensor_capture.stats_cpu) against the torch path
(tensor_capture.recorder.stats.host_row / device_row) and against the definitions.

Counts, min and max must be equal always. The sums are compared exactly on data whose every
partial sum is exact in float32 (small integers: any order gives the same bits), and within
the kernel's own error bound otherwise (float32 partials of PART values per lane, then float64).
"""
from __future__ import annotations

import ctypes
import math

import pytest
import torch
from error_bounds import exact_sum, exact_sumsq, gamma

from quant import cbuild
from tensor_capture import stats_cpu
from tensor_capture.recorder.stats import (
    FLUSH,
    INF,
    MAX,
    MIN,
    N_STATS,
    NAN,
    SAT,
    SUM,
    SUMSQ,
    bounds,
    device_row,
    host_row,
    judged_format,
)

CHUNK = 64 * stats_cpu.PART          # one chunk of the kernel's lanes (a tail follows it)


@pytest.fixture(scope="module")
def kernel():
    if cbuild.compiler() is None:
        pytest.skip("no C compiler here: the recorder keeps the torch path")
    return stats_cpu.load()            # a compiler that cannot build it is a failure


def _row(kernel, x: torch.Tensor, fmt) -> list[float]:
    out = (ctypes.c_double * N_STATS)()
    assert kernel.row_into(x, fmt, ctypes.addressof(out))
    return list(out)


def _integers(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values in -8..8 (exact in bfloat16 too) and 512 (saturates in fp8_e4m3): every partial
    sum of values and of squares below 2^24, so exact in float32 in any order."""
    x = torch.randint(-8, 9, (n,), generator=torch.Generator().manual_seed(seed)).float()
    x[n // 3] = 512.0
    assert n * 64 + 512 ** 2 < 2 ** 24
    return x.to(dtype)


@pytest.mark.parametrize("quant", [None, "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 63, CHUNK, 3 * CHUNK + 37])
def test_the_kernel_row_is_the_torch_row_bit_for_bit_on_exact_data(kernel, quant, dtype, n):
    x = _integers(n, seed=n, dtype=dtype)
    fmt = judged_format(quant, dtype)
    want = host_row(x, fmt)
    assert _row(kernel, x, fmt) == want == device_row(x, fmt).tolist()
    assert want[SAT] == (quant is not None)          # 512 saturates e4m3, never float32


@pytest.mark.parametrize("where", [0, CHUNK - 1, CHUNK + 5, 3 * CHUNK + 36])
def test_nan_and_inf_anywhere_are_counted_and_left_out(kernel, where):
    """A NaN or an Inf in a chunk or in the tail makes the fast loop's sums non-finite: the
    general loop counts them and keeps the moments over the finite values."""
    x = _integers(3 * CHUNK + 37, seed=1)
    x[where], x[where // 2 + 1], x[7] = math.nan, math.inf, -math.inf
    for quant in (None, "fp8_e4m3"):
        fmt = judged_format(quant, x.dtype)
        got = _row(kernel, x, fmt)
        assert got == device_row(x, fmt).tolist() == host_row(x, fmt)
        assert (got[NAN], got[INF]) == (1, 2) and got[SAT] >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_strided_view_gives_its_contiguous_copys_row_bit_for_bit(kernel, dtype):
    """A view is gathered in the kernel in the copy's element order and chunks: the same row,
    on random data too; and the torch path's on exact data."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(300, 4, 3, 40, generator=g).to(dtype)
    for view in (base[:, :, 1:, 8:], base.transpose(0, 3), base[::3, :, 0], base[5, 1, 2]):
        fmt = judged_format("fp8_e4m3", dtype)
        assert _row(kernel, view, fmt) == _row(kernel, view.contiguous(), fmt)
    x = _integers(2 * CHUNK + 64, seed=2, dtype=dtype).reshape(-1, 64).t()
    assert not x.is_contiguous()
    assert _row(kernel, x, None) == host_row(x, None)
    deep = torch.arange(24.0).reshape((1,) * 15 + (2, 3, 4)).transpose(-1, -3).to(dtype)
    assert deep.dim() > stats_cpu.MAX_DIMS and not deep.is_contiguous()    # copied first
    assert _row(kernel, deep, None) == host_row(deep, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runs_copied_whole_and_chunks_read_in_place_keep_the_copys_row(kernel, dtype):
    """The gather's fast paths: unit-stride runs longer than a chunk (whole chunks read in
    place when the buffer is empty, the rest copied behind a partial buffer), size-1 and
    mergeable dimensions, an expanded (stride 0) dimension: each the contiguous copy's row."""
    g = torch.Generator().manual_seed(5)
    wide = (torch.randn(5, 3 * CHUNK + 100, generator=g) * 3).to(dtype)
    cube = torch.randn(7, 1, 6, 5, 70, generator=g).to(dtype)
    views = (wide[:, 7:], wide[:, :2 * CHUNK], wide[1:4, 3:CHUNK + 3], cube[:, :, :, 1:],
             cube.transpose(0, 2), cube[:, :, 2:3, 4], wide[2:3, 11].expand(3, 900),
             wide[:, 5:9].unsqueeze(1).expand(5, 700, 4))
    fmt = judged_format("fp8_e4m3", dtype)
    for view in views:
        assert not view.is_contiguous()
        assert _row(kernel, view, fmt) == _row(kernel, view.contiguous(), fmt), view.shape


def test_a_recorder_slot_is_the_row_then_the_count_and_the_seen_flag(kernel):
    """slot_into: row_into's row (bounds given once per slot) followed by numel and 1.0, for a
    contiguous tensor, a strided view and a dtype it does not read (nothing written)."""
    x = torch.randn(3 * CHUNK + 5, generator=torch.Generator().manual_seed(6)) * 300
    fmt = judged_format("fp8_e4m3", x.dtype)
    for t in (x, x[1::3], x[:-5].reshape(-1, 8)[:, 1:]):
        out = (ctypes.c_double * (N_STATS + 2))(*([-7.0] * (N_STATS + 2)))
        assert kernel.slot_into(t, *bounds(fmt), ctypes.addressof(out))
        assert list(out) == _row(kernel, t, fmt) + [t.numel(), 1.0]
    out = (ctypes.c_double * (N_STATS + 2))()
    assert not kernel.slot_into(x.double(), *bounds(None), ctypes.addressof(out))
    assert list(out) == [0.0] * (N_STATS + 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sums_on_random_data_hold_the_kernels_error_bound(kernel, dtype):
    x = (torch.randn(5 * CHUNK + 11, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    fmt = judged_format("fp8_e4m3", dtype)
    got, torch_row = _row(kernel, x, fmt), host_row(x, fmt)
    for i in (MIN, MAX, NAN, INF, FLUSH, SAT):
        assert got[i] == torch_row[i], i
    # float32 partials of PART values per lane (a square rounds once more), then float64
    # additions of the partials; the float64 reference errs by its own float64 bound
    v = x.double()
    n = v.numel()
    for i, exact, terms in ((SUM, exact_sum(v), v.abs()), (SUMSQ, exact_sumsq(v), v * v)):
        bound = (gamma(stats_cpu.PART, torch.float32)
                 + 2 * gamma(n, torch.float64)) * float(terms.sum())
        assert abs(got[i] - exact) <= bound, i


def test_squares_beyond_float32_take_the_float64_loop(kernel):
    """1e20 squared overflows float32: the fast loop's partial is Inf, the general loop sums
    in float64 and the row stays finite (as the torch path's float64 fallback)."""
    x = _integers(CHUNK + 3, seed=4)
    x[9] = 1e20
    got = _row(kernel, x, None)
    assert math.isfinite(got[SUMSQ]) and (got[NAN], got[INF], got[SAT]) == (0, 0, 0)
    v = x.double()
    assert abs(got[SUMSQ] - exact_sumsq(v)) <= 2 * gamma(v.numel(), torch.float64) * exact_sumsq(v)
    assert got[SUM] == exact_sum(v) and got[MAX] == float(x[9])


def test_other_dtypes_are_left_to_the_torch_path(kernel):
    out = (ctypes.c_double * N_STATS)()
    assert not kernel.row_into(torch.ones(4, dtype=torch.float64), None, ctypes.addressof(out))
    assert list(out) == [0.0] * N_STATS


def test_without_a_compiler_loading_says_so(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cbuild, "COMPILERS", ())
    with pytest.raises(ImportError, match=r"no C compiler found \(\$CC, cc, gcc, clang\)"):
        stats_cpu.load()


def test_a_compiler_that_fails_is_named_and_nothing_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")                  # found, runs, fails
    with pytest.raises(ImportError, match="false could not compile recorder_stats_"):
        stats_cpu.load()
    assert not list(tmp_path.rglob("*.so"))


def test_a_build_goes_into_the_cache_and_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = stats_cpu.load() if cbuild.compiler() else pytest.skip("no C compiler")
    assert first.path.parent == tmp_path / "megatron-lowp-tools"
    stamp = first.path.stat().st_mtime_ns
    monkeypatch.setattr(cbuild, "_compile", lambda *args: pytest.fail("compiled again"))
    assert stats_cpu.load().path == first.path and first.path.stat().st_mtime_ns == stamp
