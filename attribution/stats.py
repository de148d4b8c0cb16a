"""The arithmetic of an attribution: gaps over seeds, shares of the gap closed, seed noise.

Every comparison is paired by seed (the same seed gives the same initialization and data order
in every run), so the noise is the spread of per-seed differences, not of raw losses.

- gap_s = L_format(s) - L_reference(s); the gap is significant when its mean exceeds
  t(0.975, n-1) x its standard error (a two-sided 95 % t test on n seeds).
- An ablation A (part of the model kept in high precision) closes d_s = L_format(s) - L_A(s);
  its share of the gap is mean(d) / mean(gap), with a standard deviation of
  std(d) / mean(gap) (the seed spread of what it closes, in units of the gap); its effect is
  real when mean(d) exceeds t x its standard error.
Pure Python: tests feed synthetic numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

#: two-sided 95 % Student t quantiles t(0.975, dof), dof 1..30; above: 1.96
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_critical(dof: int) -> float:
    """t(0.975, dof): the 95 % two-sided critical value (inf for no degrees of freedom)."""
    if dof < 1:
        return math.inf
    return _T975[dof - 1] if dof <= len(_T975) else 1.96


@dataclass(frozen=True)
class Summary:
    """Mean, sample standard deviation and count of finite values."""

    mean: float
    std: float
    n: int

    @property
    def sem(self) -> float:
        return self.std / math.sqrt(self.n) if self.n > 0 else math.inf

    @property
    def significant(self) -> bool:
        """Mean above zero by more than t x standard error (needs at least 2 values)."""
        return self.n >= 2 and self.mean > t_critical(self.n - 1) * self.sem

    @property
    def nonzero(self) -> bool:
        """Mean away from zero, either sign, by more than t x standard error."""
        return self.n >= 2 and abs(self.mean) > t_critical(self.n - 1) * self.sem


def summarize(values: Sequence[float]) -> Summary:
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(vals)
    if n == 0:
        return Summary(math.nan, math.nan, 0)
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    return Summary(mean, std, n)


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> list[float]:
    """a[s] - b[s] for every seed both have (finite or not: summarize drops non-finite)."""
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


@dataclass(frozen=True)
class Closure:
    """What one ablation closes: share of the gap (and its seed spread), significance."""

    share: float
    share_std: float
    closed: Summary          # L_format - L_ablation per seed, in nats

    @property
    def significant(self) -> bool:
        """The effect (either sign: keeping a part in high precision may also widen the gap)
        is above seed noise."""
        return self.closed.nonzero


def closure(fmt: Mapping[int, float], ref: Mapping[int, float],
            ablation: Mapping[int, float]) -> Closure:
    """The share of the format's gap that ``ablation`` closes (per-seed losses in)."""
    gap = summarize(paired(fmt, ref))
    closed = summarize(paired(fmt, ablation))
    if not gap.n or not closed.n or gap.mean == 0:
        return Closure(math.nan, math.nan, closed)
    return Closure(closed.mean / gap.mean, closed.std / abs(gap.mean), closed)


def gap_summary(fmt: Mapping[int, float], ref: Mapping[int, float]) -> Summary:
    return summarize(paired(fmt, ref))


def within_noise(a: Summary, b: Summary) -> bool:
    """Whether two gaps (means over their seeds) agree within their noise: |a - b| below
    t x the standard error of the difference (Welch-style, with the smaller dof)."""
    if not (a.n and b.n):
        return False
    se = math.sqrt(a.sem ** 2 + b.sem ** 2)
    return abs(a.mean - b.mean) <= t_critical(min(a.n, b.n) - 1) * se
