"""Reading captured statistics back, without torch (the diagnosis and the report import this):
fractions of a tensor below a magnitude from its log2 histogram, and the merge of count / mean /
std over records (ranks, micro-batches): counts, sums and sums of squares add; an average of
standard deviations is not the standard deviation of the union.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def _bins(log2_hist: dict[str, Any] | None) -> list[tuple[int, int]]:
    """(exponent e, count of |x| in [2^e, 2^(e+1))) of a captured ``log2_hist``."""
    if not log2_hist or not log2_hist.get("counts"):
        return []
    lo = int(log2_hist["min_exp"])
    return [(lo + i, int(c)) for i, c in enumerate(log2_hist["counts"]) if c]


def fraction_below(log2_hist: dict[str, Any] | None, bound: float, energy: bool = False,
                   within: int | None = None) -> float:
    """The fraction of a tensor's nonzero elements (``energy``: of its energy, sum of x^2)
    whose magnitude lies wholly below ``bound``, read from its captured log2 histogram: the
    binades [2^e, 2^(e+1)) with 2^(e+1) <= bound (exact for a power-of-two bound, a lower bound
    otherwise). The energy of a binade is its count x 4^e x 7/3 (the mean of x^2 over a binade);
    the constant cancels in the ratio. ``within``: count only the binades at most that many
    below the tensor's top binade (smaller values vanish beside the largest in any sum)."""
    bins = _bins(log2_hist)
    if not bins or bound <= 0:
        return 0.0
    top = max(e for e, _ in bins)
    weight = (lambda e: 4.0 ** (e - top)) if energy else (lambda e: 1.0)
    total = sum(c * weight(e) for e, c in bins)
    floor = -math.inf if within is None else top - within
    below = sum(c * weight(e) for e, c in bins
                if math.ldexp(1.0, e + 1) <= bound and e >= floor)
    return below / total if total else 0.0


def merge_moments(parts: Sequence[tuple[int, float, float]]) -> tuple[int, float, float]:
    """(count, mean, std) of the union of tensors given each one's (count, mean, std): counts,
    sums and sums of squares add, averages of std do not. ``std`` is the sample standard
    deviation (n - 1), as tensor_capture.stats.compute records it; :data:`MERGED_STD_SQL` is the same in SQL."""
    n = sum(p[0] for p in parts)
    if n == 0:
        return 0, math.nan, math.nan
    total = sum(c * m for c, m, _ in parts)
    squares = sum((c - 1) * s * s + c * m * m for c, m, s in parts if c)
    mean = total / n
    var = (squares - n * mean * mean) / (n - 1) if n > 1 else 0.0
    return n, mean, math.sqrt(max(var, 0.0))


def merged_std_sql(n: str = "numel", mean: str = "mean", std: str = "std") -> str:
    """The aggregate SQL expression of :func:`merge_moments`' std over the rows of a GROUP BY
    (columns ``n``, ``mean``, ``std`` per record)."""
    total, count = f"sum({n} * {mean})", f"sum({n})"
    squares = f"sum(({n} - 1) * {std} * {std} + {n} * {mean} * {mean})"
    return (f"sqrt(greatest(({squares} - {total} * {total} / {count}) / "
            f"greatest({count} - 1, 1), 0))")
