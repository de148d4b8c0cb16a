"""The in-memory view the plots draw from: entries with stored stats and small samples."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

import numpy as np

from tensor_viz.catalog import Entry


@dataclass
class PairError:
    """Measured error of a saved quantized operand against its high-precision twin."""

    hp: Entry
    quantized: Entry
    errors: dict[str, float]


@dataclass
class Dataset:
    entries: list[Entry]
    pairs: list[PairError] = field(default_factory=list)
    whatif_formats: tuple[str, ...] = ()
    notes: dict[str, str] = field(default_factory=dict)   # section -> why something is missing
    numerics: list[dict[str, Any]] = field(default_factory=list)   # numerics_data.rows(entries)
    rank_view: Any = None   # rank_tables.RankView: header and outlier ranks from the columnar index
    capture_dir: str = ""   # the folder read (figures from files beside the records: the recorder's)

    def sampled(self, entries: Iterable[Entry] | None = None) -> list[Entry]:
        return [e for e in (self.entries if entries is None else entries) if e.sample is not None]

    def with_stats(self) -> list[Entry]:
        return [e for e in self.entries if e.stats]


def group(entries: Iterable[Entry], key: Callable[[Entry], Hashable]) -> dict[Any, list[Entry]]:
    """Entries by ``key``, keys sorted (None last) so figures come out in a stable order."""
    out: dict[Any, list[Entry]] = defaultdict(list)
    for e in entries:
        out[key(e)].append(e)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is None, str(kv[0]))))


def values(entries: Iterable[Entry]) -> np.ndarray:
    """Finite sampled values of ``entries`` as one float64 array (empty if none)."""
    parts = [e.sample for e in entries if e.sample is not None and len(e.sample)]
    if not parts:
        return np.zeros(0)
    v = np.concatenate(parts).astype(np.float64)
    return v[np.isfinite(v)]


def stat(e: Entry, key: str) -> float | None:
    v = (e.stats or {}).get(key)
    return float(v) if isinstance(v, (int, float)) and np.isfinite(v) else None


def ratio(e: Entry, key: str) -> float | None:
    """A range ratio (overflow_ratio, underflow_ratio, ...) against the entry's own format."""
    rs = e.range_stats()
    if rs is None:
        return None
    v = rs[1].get(key)
    return float(v) if isinstance(v, (int, float)) else None


def moments(sample: np.ndarray) -> tuple[float, float, float]:
    """Variance, skewness, excess kurtosis of a sample (0 for constant samples)."""
    x = sample[np.isfinite(sample)].astype(np.float64)
    if x.size < 2:
        return 0.0, 0.0, 0.0
    mu, var = x.mean(), x.var()
    if var == 0:
        return 0.0, 0.0, 0.0
    z = (x - mu) / np.sqrt(var)
    return float(var), float((z ** 3).mean()), float((z ** 4).mean() - 3.0)


def ks_normal(sample: np.ndarray) -> float | None:
    """Kolmogorov-Smirnov distance of the standardized sample to N(0, 1)."""
    import torch

    x = np.sort(sample[np.isfinite(sample)].astype(np.float64))
    if x.size < 8 or x.std() == 0:
        return None
    z = torch.from_numpy((x - x.mean()) / x.std())
    cdf = torch.special.ndtr(z).numpy()
    n = x.size
    upper = np.arange(1, n + 1) / n - cdf
    lower = cdf - np.arange(0, n) / n
    return float(max(upper.max(), lower.max()))
