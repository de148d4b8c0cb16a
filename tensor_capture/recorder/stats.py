"""The flight recorder's statistics of one tensor: mergeable numbers in the fewest passes.

Why not tensor_capture.stats: that vector (histogram, std, min nonzero, range counts of every
format in play) costs ten or more passes per tensor, fine for the iterations a capture saves and
too much for every iteration of a long run. The recorder keeps only what merges over
micro-batches, iterations and ranks without losing meaning (schema.REC_STATS: sums add,
extremes take theirs, counts add), judged against one format: CUSTOM_QUANT_TYPE's element
format when it is unscaled, else the tensor's own dtype, with quant.analysis' one definition of
saturation (upper and lower overflow, +-Inf included) and flush to zero (stats.RangeSpec).

Two paths here, the same numbers (and for CPU tensors first a third: tensor_capture.stats_cpu's
one-pass C kernel, which the recorder prefers where it builds):

- host (CPU tensors): dot(x, x), sum, amin and amax, piece by piece for a large tensor (one
  pass from memory, three over the cached piece); the NaN / Inf counts only
  when the sums are not finite, the format's counts only when the format is not the tensor's
  own dtype (a value of a dtype never saturates or flushes in that same dtype, so those counts
  are then the Inf count and 0). Branching on a value is free on the host.
- device (CUDA and the rare non-finite host case): every count computed without branching, so
  nothing waits for the device; the row is copied into the recorder's device buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .. import schema, stats

N_STATS = len(schema.REC_STAT_ROWS)
#: where the paths below write each statistic: its row's index in schema.REC_STAT_ROWS
SUM, SUMSQ, MIN, MAX, NAN, INF, FLUSH, SAT = map(schema.REC_STATS.index, (
    "sum", "sumsq", "min", "max", "nan_count", "inf_count", "flush_count", "saturation_count"))

#: the row of an empty tensor: each row's identity
EMPTY_ROW = tuple(r.identity for r in schema.REC_STAT_ROWS)


def placed(values: dict[int, Any]) -> list[Any]:
    """``values`` by row index as a row (schema.REC_STAT_ROWS order): the paths fill a row by
    name, never by position."""
    return [values[i] for i in range(N_STATS)]


@dataclass(frozen=True)
class Judged:
    """The format a tensor is judged against: its name (the record's quant_type range key),
    where values saturate (|x| >= overflow) and flush (0 < |x| < flush), and whether it is the
    tensor's own dtype (then both counts need no pass)."""

    name: str
    overflow: float
    flush: float
    own_dtype: bool
    spec: stats.RangeSpec             # the limits themselves (the fused kernel takes them)


def judged_format(quant_type: str | None, dtype: torch.dtype) -> Judged | None:
    """The run's format for a tensor of ``dtype``: the unscaled CUSTOM_QUANT_TYPE element format
    (stats.format_range), else the dtype's own range; None for a dtype without one."""
    ct = _compute_dtype(dtype)
    spec = stats.format_range(quant_type) if quant_type else None
    own = spec is None
    if own:
        spec = stats.dtype_range(dtype)
    if spec is None:
        return None
    return Judged(spec.name, spec.overflow_bound(ct), spec.flush_bound(ct), own, spec)


def bounds(fmt: Judged | None) -> tuple[float, float]:
    """(overflow, flush) the CPU kernel (tensor_capture.stats_cpu) compares |x| with: the
    format's; none for a tensor judged in its own dtype (a value never saturates or flushes
    there: the saturation count is then the Inf count, as defined here, and the flush count 0)."""
    if fmt is None or fmt.own_dtype:
        return math.inf, 0.0
    return fmt.overflow, fmt.flush


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flat(x: torch.Tensor) -> torch.Tensor:
    a = x.detach().reshape(-1)
    ct = _compute_dtype(a.dtype)
    return a if a.dtype == ct else a.to(ct)


#: elements per piece of a large CPU tensor (1 MiB of float32: stays in a core's cache while the
#: four reductions run over it, so only the first reads memory; 1.7x faster on an 11 MB tensor)
CHUNK = 1 << 18


def _moments(a: torch.Tensor) -> tuple[float, float, float, float]:
    """(sum, sum of squares, min, max) of a flat CPU tensor. The BLAS dot product first (it
    streams from memory fastest), then sum, amin and amax over the cached piece (amin and amax
    separately: aminmax is about three times slower than both on a CPU)."""
    q = float(torch.dot(a, a))
    return float(a.sum()), q, float(a.amin()), float(a.amax())


def _chunked(a: torch.Tensor) -> tuple[float, float, float, float]:
    """:func:`_moments` piece by piece (sums added in float64)."""
    s = q = 0.0
    lo, hi = math.inf, -math.inf
    for piece in a.split(CHUNK):
        ps, pq, plo, phi = _moments(piece)
        s, q, lo, hi = s + ps, q + pq, min(lo, plo), max(hi, phi)
    return s, q, lo, hi


def host_row(x: torch.Tensor, fmt: Judged | None) -> list[float]:
    """The statistics of a CPU tensor as floats (schema.REC_STATS order)."""
    a = _flat(x)
    if a.numel() == 0:
        return list(EMPTY_ROW)
    s, q, lo, hi = _moments(a) if a.numel() <= CHUNK else _chunked(a)
    if not (math.isfinite(s) and math.isfinite(q)):
        return device_row(x, fmt).tolist()      # NaN / Inf present (or a square overflowed)
    row = placed({SUM: s, SUMSQ: q, MIN: lo, MAX: hi, NAN: 0.0, INF: 0.0, FLUSH: 0.0, SAT: 0.0})
    if fmt is not None and not fmt.own_dtype:
        up = fmt.overflow
        if row[MAX] >= up or row[MIN] <= -up:
            row[SAT] = float((a.abs() >= up).sum())
        absa = a.abs()
        row[FLUSH] = float(((absa < fmt.flush) & (absa > 0)).sum())
    return row


def device_row(x: torch.Tensor, fmt: Judged | None, kernel: bool | None = None) -> torch.Tensor:
    """The statistics of any tensor as a float64 vector on its device, with no host sync.
    ``kernel`` (default: on for CUDA tensors when Triton imports): from tensor_capture.stats'
    fused Triton pass, one read of the tensor, instead of a dozen torch reductions."""
    if kernel is None:
        kernel = x.is_cuda and stats.fused_kernel_available()
    if kernel and x.numel() and x.dtype != torch.float64:
        return _kernel_row(x, fmt)
    a = _flat(x)
    n = a.numel()
    dev = a.device
    if n == 0:
        return torch.tensor(EMPTY_ROW, dtype=torch.float64, device=dev)
    finite = torch.isfinite(a)
    nan = torch.isnan(a).sum()
    inf = n - finite.sum() - nan
    fa = torch.where(finite, a, 0.0)
    fd = fa.double()
    s = fd.sum()
    q = torch.dot(fd, fd)
    big = torch.tensor(math.inf, dtype=a.dtype, device=dev)
    mn = torch.where(finite, a, big).amin().double()
    mx = torch.where(finite, a, -big).amax().double()
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    if fmt is None or fmt.own_dtype:
        flush, sat = zero, inf
    else:
        absf = fa.abs()
        sat = (absf >= fmt.overflow).sum() + inf
        flush = ((absf < fmt.flush) & (absf > 0)).sum()
    return torch.stack(placed({SUM: s, SUMSQ: q, MIN: mn, MAX: mx, NAN: nan.double(),
                               INF: inf.double(), FLUSH: flush.double(), SAT: sat.double()}))


#: where tensor_capture.stats' packed vector holds what the row needs (see stats._SCALARS)
_N, _LO, _HI, _MEAN, _STD, _NANS, _INFS = 0, 1, 2, 3, 4, 7, 8
_RANGES = 9            # then upper overflow, lower overflow, underflow, flush of the first spec


def _kernel_row(x: torch.Tensor, fmt: Judged | None) -> torch.Tensor:
    """The row from the fused pass: sums from its finite mean and std (n - 1), the counts as
    they are (upper + lower overflow, +-Inf included, is the saturation; its flush count)."""
    ranges = (fmt.spec,) if fmt is not None else ()
    v = stats.compute(x, ranges, kernel=True)
    n, nan, inf = v[_N], v[_NANS], v[_INFS]
    nf = n - nan - inf
    some = nf > 0
    mean = torch.where(some, v[_MEAN], 0.0)
    std = torch.where(nf > 1, v[_STD], 0.0)
    total = mean * nf
    sumsq = std * std * (nf - 1).clamp_min(0) + nf * mean * mean
    lo = torch.where(some, v[_LO], math.inf)
    hi = torch.where(some, v[_HI], -math.inf)
    if ranges:
        sat = v[_RANGES] + v[_RANGES + 1]
        flush = v[_RANGES + 3]
    else:
        sat, flush = inf, torch.zeros_like(inf)
    return torch.stack(placed({SUM: total, SUMSQ: sumsq, MIN: lo, MAX: hi, NAN: nan, INF: inf,
                               FLUSH: flush, SAT: sat}))
