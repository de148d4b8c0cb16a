"""THE judgment of "bad" for a tensor in a format: its SQNR against the format's own baseline.

Why relative: a Gaussian is what MX / NVFP4 / FP8 formats are designed for, yet a Gaussian
flushes a few percent of its elements in mxfp4 and sits partly in fp8's subnormal range. A
fixed ratio threshold (1 % of elements, :func:`quant.analysis.severity`) calls every ordinary tensor HIGH. Here a tensor is
bad in a format only when quantizing it loses clearly more signal than quantizing
well-conditioned data does: its SQNR is below the format's *baseline* SQNR -- the SQNR of
standard Gaussian data of the same shape, blocked along the same axis -- by more than a stated
margin. Values in a subnormal range therefore count by what they lose (their share of the noise),
not by where they sit.

Margins (dB below the baseline; ~6 dB is one bit): more than :data:`MARGIN_MEDIUM_DB` (a bit
lost) -> ``medium``, more than :data:`MARGIN_HIGH_DB` (two and a half bits) -> ``high``; anything
closer is ``none``. Every verdict that says a tensor suits a format or not
(``analyze_tensor``'s risk level, the emulation's pre-quantization warning, ``lowp-diagnose``'s
``format_loss`` finding) calls :func:`loss_severity`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from . import metrics
from .fakequant import quantize
from .formats import FormatSpec, get_format

MARGIN_MEDIUM_DB = 6.0
MARGIN_HIGH_DB = 15.0
#: the baseline's Gaussian keeps the axis length but at most this many elements
BASELINE_MAX_ELEMENTS = 1 << 16
_SEED = 20261125


def _baseline_shape(shape: Sequence[int], axis: int) -> tuple[tuple[int, ...], int]:
    """(the shape of the baseline sample, its axis): the blocked axis whole, other axes folded
    into rows, at most BASELINE_MAX_ELEMENTS elements."""
    dims = [max(int(d), 1) for d in shape] or [1]
    axis = axis % len(dims)
    length = dims[axis]
    rows = max(1, math.prod(dims) // length)
    rows = max(1, min(rows, BASELINE_MAX_ELEMENTS // max(length, 1)))
    return (rows, length), 1


@lru_cache(maxsize=4096)
def baseline_sqnr(fmt: str, shape: tuple[int, ...], axis: int = -1) -> float:
    """SQNR (dB) of a standard Gaussian of ``shape`` quantized to ``fmt`` along ``axis`` (a fixed
    seed: the same number every time)."""
    spec = get_format(fmt)
    bshape, baxis = _baseline_shape(shape, axis)
    gen = torch.Generator().manual_seed(_SEED)
    x = torch.randn(bshape, generator=gen)
    return metrics.sqnr(x, quantize(x, spec, axis=baxis, backend="torch"))


def loss_severity(sqnr_db: float | None, baseline_db: float) -> str:
    """'high' / 'medium' / 'none' from how far ``sqnr_db`` falls below the baseline."""
    if sqnr_db is None or (isinstance(sqnr_db, float) and math.isnan(sqnr_db)):
        return "none"
    deficit = baseline_db - sqnr_db
    if deficit > MARGIN_HIGH_DB:
        return "high"
    if deficit > MARGIN_MEDIUM_DB:
        return "medium"
    return "none"


@dataclass(frozen=True)
class FormatLoss:
    """What quantizing one tensor to one format loses, against the format's baseline."""

    format: str
    sqnr_db: float
    baseline_db: float
    severity: str

    @property
    def deficit_db(self) -> float:
        return self.baseline_db - self.sqnr_db

    def to_dict(self) -> dict:
        return {"format": self.format, "sqnr_db": self.sqnr_db, "baseline_db": self.baseline_db,
                "deficit_db": self.deficit_db, "severity": self.severity}


def judge(x: torch.Tensor, fmt: str | FormatSpec, axis: int = -1,
          quantized: torch.Tensor | None = None) -> FormatLoss:
    """The :class:`FormatLoss` of ``x`` in ``fmt`` (blocks along ``axis``; pass ``quantized``
    when the caller already has it). Non-finite elements are left out of the SQNR (a NaN is
    reported by the NaN counts, not as quantization noise)."""
    spec = get_format(fmt)
    x = x.detach()
    q = quantize(x, spec, axis=axis) if quantized is None else quantized.detach()
    x32, q32 = x.float(), q.float()
    ok = torch.isfinite(x32) & torch.isfinite(q32)
    if not bool(ok.all()):
        x32, q32 = torch.where(ok, x32, 0.0), torch.where(ok, q32, 0.0)
    sq = metrics.sqnr(x32, q32)
    base = baseline_sqnr(spec.name, tuple(x.shape) or (1,), axis)
    return FormatLoss(spec.name, sq, base, loss_severity(sq, base))
