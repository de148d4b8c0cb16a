"""The fused Triton statistics pass equals the torch statistics (CPU: Triton's interpreter).

Counts, min / max, smallest nonzero and the log2 histogram are exact; mean and std are float64
sums in another order (each within float64's summation bound, tests/error_bounds.py).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from error_bounds import mean_error_bound, std_error_bound
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

from quant import backends  # noqa: E402
from tensor_capture import stats  # noqa: E402
from tensor_capture.stats import RangeSpec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not backends.triton_interpreting() else "cpu"
SPECS = [stats.format_range("fp8_e4m3"), stats.format_range("fp8_e5m2"),
         stats.format_range("hifp8"), stats.dtype_range(torch.float16),
         stats.dtype_range(torch.bfloat16),
         RangeSpec("odd", 300.0, 0.003, 0.0001, overflow_from=300.0, flush_to=0.00005)]


def _same(x: torch.Tensor, specs=SPECS) -> None:
    want = stats.decode(stats.compute(x, specs, host_path=False, kernel=False).cpu(), specs)
    got = stats.decode(stats.compute(x, specs, kernel=True).cpu(), specs)
    finite = x[torch.isfinite(x)].cpu().double()
    # both accumulate in float64, in other orders: each within float64's bound of the exact value
    bounds = {"mean": 2 * mean_error_bound(finite, torch.float64),
              "std": 2 * std_error_bound(finite, torch.float64)}
    for key, bound in bounds.items():
        w, g = want.pop(key), got.pop(key)
        assert (math.isnan(w) and math.isnan(g)) or abs(w - g) <= bound, key
    assert got == want


def _mixed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 100, (n,), generator=g).float())
    k = torch.randint(0, n, (max(n // 20, 1),), generator=g)
    x[k[0::4]] = 0.0
    x[k[1::4]] = float("nan")
    x[k[2::4]] = float("inf")
    x[k[3::4]] = -float("inf")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_torch_statistics(dtype):
    for n in (1, 77, 4096, 9000):            # one tile, partial tiles, several tiles
        _same(_mixed(n, n).to(dtype).to(DEVICE))


def test_edge_tensors():
    cases = [torch.zeros(50), torch.full((30,), float("nan")), torch.full((5,), float("inf")),
             torch.tensor([1e-45, -1e-44, 2.0 ** -126, 3e38, -3e38]),   # subnormal, huge
             torch.randn(40, 30).t(),                                     # non-contiguous
             torch.tensor([1.0e30, 1.0e30 + 1e24, -2e30])]                # squares beyond fp32
    for x in cases:
        _same(x.to(DEVICE))
    _same(torch.randn(100).to(DEVICE), specs=[])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1,
                max_size=120),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_kernel_matches_brute_force_counts(values, dtype):
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    s = stats.decode(stats.compute(x.to(DEVICE), SPECS, kernel=True).cpu(), SPECS)
    xs = x.double().numpy()
    assert s["nan_count"] == int(np.isnan(xs).sum())
    assert s["inf_count"] == int(np.isinf(xs).sum())
    fin = xs[np.isfinite(xs)]
    nz = np.abs(fin[fin != 0])
    assert sum(s["log2_hist"]["counts"]) == nz.size
    if nz.size:
        assert s["min_nonzero_abs"] == nz.min()
        assert s["min"] == fin.min() and s["max"] == fin.max()
