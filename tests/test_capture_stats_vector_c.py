"""The C kernel of a CPU tensor's capture statistics (tensor_capture.stats_vector_c) against the
device path (the definitions in torch, float64 sums).

Counts, min, max, the smallest nonzero magnitude and the log2 histogram must be equal always;
mean and std are float64 sums in another order: equal on data whose every sum is exact (small
integers, each with its negative), within float64's summation bound otherwise.
"""
from __future__ import annotations

import math

import pytest
import torch
from error_bounds import mean_error_bound, std_error_bound

from quant import cbuild
from tensor_capture import stats, stats_vector_c
from tensor_capture.stats import RangeSpec

SPECS = [stats.format_range("fp8_e4m3"), stats.format_range("fp8_e5m2"),
         stats.format_range("hifp8"), stats.dtype_range(torch.float16),
         stats.dtype_range(torch.bfloat16),
         RangeSpec("odd", 300.0, 0.003, 0.0001, overflow_from=300.0, flush_to=0.00005)]
CHUNK = 2048                            # the kernel's chunk (a tail and several chunks below)
MEAN, STD = stats._SCALARS.index("mean"), stats._SCALARS.index("std")   # packed vector slots


@pytest.fixture(scope="module")
def kernel():
    if cbuild.compiler() is None:
        pytest.skip("no C compiler here: CPU statistics keep the torch host path")
    k = stats.CPU_VECTOR_KERNEL.get()
    assert k is not None, stats.CPU_VECTOR_KERNEL.error   # a compiler that cannot build it fails
    return k


def _mixed(n: int, seed: int) -> torch.Tensor:
    """Magnitudes from float32 subnormals to 2^100, with zeros, NaN and +-Inf scattered."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-160, 100, (n,), generator=g).float())
    k = torch.randint(0, n, (max(n // 20, 1),), generator=g)
    x[k[0::4]] = 0.0
    x[k[1::4]] = math.nan
    x[k[2::4]] = math.inf
    x[k[3::4]] = -math.inf
    return x


def _compare(kernel, x: torch.Tensor, ranges=SPECS) -> None:
    got = kernel.vector(x, ranges)
    want = stats.compute(x, ranges, host_path=False)
    assert got is not None and got.shape == want.shape
    exact = [i for i in range(got.numel()) if i not in (MEAN, STD)]
    assert torch.equal(got[exact], want[exact]), (got[exact] != want[exact]).nonzero()[:5]
    finite = x[torch.isfinite(x)].double()
    if finite.numel() > 1:
        assert abs(got[MEAN] - want[MEAN]) <= 2 * mean_error_bound(finite, torch.float64)
        assert abs(got[STD] - want[STD]) <= 2 * std_error_bound(finite, torch.float64)


@pytest.mark.parametrize("dtype", list(stats_vector_c.DTYPE_CODES))
@pytest.mark.parametrize("n", [1, 77, CHUNK, CHUNK + 1, 4 * CHUNK + 13])
def test_the_vector_is_the_device_paths(kernel, dtype, n):
    _compare(kernel, _mixed(n, n).to(dtype))


@pytest.mark.parametrize("dtype", list(stats_vector_c.DTYPE_CODES))
def test_on_exact_data_every_slot_is_equal(kernel, dtype):
    x = stats_vector_c.probe_values().to(dtype)
    assert torch.equal(kernel.vector(x, SPECS), stats.compute(x, SPECS, host_path=False))


def test_a_subnormal_in_any_chunk_is_binned_where_the_zeros_are_not(kernel):
    x = torch.zeros(3 * CHUNK)
    x[CHUNK + 5] = 2.0 ** -149             # the second chunk: its field 0 holds more than zeros
    x[2 * CHUNK + 7] = 3 * 2.0 ** -130
    x[11] = 1.0
    h = stats.decode(kernel.vector(x, []))["log2_hist"]
    assert h["min_exp"] == -149 and sum(h["counts"]) == 3
    assert h["counts"][-129 + 149] == 1 and h["counts"][-1] == 1


def test_all_nan_and_all_inf(kernel):
    for value in (math.nan, math.inf):
        x = torch.full((CHUNK + 3,), value)
        _compare(kernel, x)
        s = stats.decode(kernel.vector(x, SPECS), SPECS)
        assert s["min"] is None and s["min_nonzero_abs"] is None


def test_a_strided_tensor_is_its_contiguous_copy(kernel):
    base = _mixed(64 * 96, 3).reshape(64, 96)
    view = base.t()[::3]
    assert not view.is_contiguous()
    assert torch.equal(kernel.vector(view, SPECS), kernel.vector(view.contiguous(), SPECS))


def test_what_the_kernel_does_not_read_goes_to_torch(kernel):
    assert kernel.vector(torch.ones(4, dtype=torch.float64), SPECS) is None
    assert kernel.vector(torch.ones(0), SPECS) is None
    many = SPECS * 3                      # more ranges than MAX_RANGES
    assert len(many) > stats_vector_c.MAX_RANGES and kernel.vector(torch.ones(4), many) is None
    x = torch.randn(100, dtype=torch.float64)      # compute() still answers, by torch
    assert torch.equal(stats.compute(x, SPECS), stats.compute(x, SPECS, c_kernel=False))


def test_compute_takes_the_kernel_by_default_on_the_cpu(kernel, monkeypatch):
    calls = []
    real = type(kernel).vector
    monkeypatch.setattr(type(kernel), "vector",
                        lambda self, x, r: calls.append(x.shape) or real(self, x, r))
    stats.compute(torch.randn(5, 7), SPECS)
    stats.compute(torch.randn(5, 7), SPECS, c_kernel=False)
    assert calls == [(5, 7)]


def test_a_kernel_that_disagrees_on_the_probe_is_refused(kernel, monkeypatch, capsys):
    real = type(kernel).vector

    def off_by_one(self, x, ranges):
        v = real(self, x, ranges)
        v[len(stats._SCALARS)] += 1         # the first range count
        return v

    monkeypatch.setattr(type(kernel), "vector", off_by_one)
    with pytest.raises(ImportError, match="disagrees with the definitions on its probe"):
        stats._load_cpu_vector_kernel()
    err = capsys.readouterr().err                  # said once, in one line
    assert err.count("\n") == 1 and err.startswith("tensor capture: the compiled capture")
    assert err.rstrip().endswith("CPU statistics by torch (the same numbers, slower)")


def test_without_a_compiler_compute_keeps_the_torch_path(monkeypatch, capsys):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cbuild, "COMPILERS", ())
    monkeypatch.setattr(stats, "CPU_VECTOR_KERNEL", stats.OptionalModule(
        stats._load_cpu_vector_kernel))
    x = torch.randn(300)
    assert torch.equal(stats.compute(x, SPECS), stats.compute(x, SPECS, c_kernel=False))
    assert "no C compiler found" in str(stats.CPU_VECTOR_KERNEL.error)
    assert capsys.readouterr().err == ""           # no compiler: silently torch
    with pytest.raises(RuntimeError, match="c_kernel=True need the C kernel: no C compiler"):
        stats.compute(x, SPECS, c_kernel=True)
