"""Statistics of a tensor in the schema's layout, for files saved without them.

Layout (tensor_capture/schema.py): STAT_KEYS, stats["range"][name] with overflow /
underflow / flush-to-zero counts and ratios, stats["log2_hist"].
"""
from __future__ import annotations

from typing import Any

import torch

from tensor_capture import schema
from tensor_viz.formats import Limits


def range_counts(x: torch.Tensor, limits: Limits) -> dict[str, float]:
    """Overflow / underflow counts of finite-or-inf values ``x`` (float32, flat) against limits."""
    max_normal, min_normal, min_sub = limits
    n = max(int(x.numel()), 1)
    a = x.abs()
    nonzero = a > 0
    counts = {
        "upper_overflow_count": int((x > max_normal).sum()),
        "lower_overflow_count": int((x < -max_normal).sum()),
        "underflow_count": int((nonzero & (a < min_normal)).sum()),
        "flush_to_zero_count": int((nonzero & (a < min_sub / 2)).sum()),
    }
    counts["overflow_count"] = counts["upper_overflow_count"] + counts["lower_overflow_count"]
    out: dict[str, float] = dict(counts)
    for key, value in counts.items():
        out[key.replace("_count", "_ratio")] = value / n
    return out


def stats_from_values(t: torch.Tensor, limits: dict[str, Limits]) -> dict[str, Any]:
    """Whole-tensor statistics (STAT_KEYS, range per name in ``limits``, log2 histogram)."""
    x = t.detach().reshape(-1).to(torch.float32)
    n = int(x.numel())
    finite_mask = torch.isfinite(x)
    finite = x[finite_mask]
    a = finite.abs()
    nz = a[a > 0]
    stats: dict[str, Any] = {
        "numel": n,
        "nan_count": int(torch.isnan(x).sum()),
        "inf_count": int(torch.isinf(x).sum()),
        "zero_count": int((x == 0).sum()),
    }
    if finite.numel():
        f64 = finite.to(torch.float64)
        stats.update(
            min=float(finite.min()), max=float(finite.max()), mean=float(f64.mean()),
            std=float(f64.std(unbiased=False)), absmax=float(a.max()),
        )
    else:
        stats.update(min=None, max=None, mean=None, std=None, absmax=None)
    stats["min_nonzero_abs"] = float(nz.min()) if nz.numel() else None
    stats[schema.STAT_RANGE] = {name: range_counts(x, lim) for name, lim in limits.items()}
    if nz.numel():
        _, exp = torch.frexp(nz)  # |x| = m * 2**exp with m in [0.5, 1): floor(log2|x|) = exp - 1
        e = exp.to(torch.int64) - 1
        e0 = int(e.min())
        counts = torch.bincount(e - e0).tolist()
        stats[schema.STAT_LOG2_HIST] = {"min_exp": e0, "counts": counts}
    else:
        stats[schema.STAT_LOG2_HIST] = {"min_exp": 0, "counts": []}
    return stats
