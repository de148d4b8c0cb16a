"""The what-if record of one tensor under one format: the dicts :mod:`quant.whatif` documents,
built from per-block arrays and error counts. Both the per-format path (``quant.whatif``) and the
one-pass path (``quant.whatif_onepass``) build their output here, so the two cannot differ in
shape or key names."""
from __future__ import annotations

from typing import Any, Optional

import torch

from .families import family_of
from .family_mx import MX
from .family_nvfp4 import NVFP4
from .formats import FormatSpec

# The record's keys (quant.whatif documents them; readers use these names, not literals)
AXIS, SQNR_DB, REL_ERROR = "axis", "sqnr_db", "rel_error"
OVERFLOW_RATIO, UNDERFLOW_RATIO, FLUSH_RATIO = "overflow_ratio", "underflow_ratio", "flush_ratio"
#: the scalar numbers every format has (besides the axis)
SCALAR_KEYS = (SQNR_DB, REL_ERROR, OVERFLOW_RATIO, UNDERFLOW_RATIO, FLUSH_RATIO)
BLOCK_SIZE, AXIS_LENGTH, BLOCKS, SHORT_AXIS = "block_size", "axis_length", "blocks", "short_axis"
BLOCK_SCALE, BLOCK_CLIPPED_HIST = "block_scale", "block_clipped_hist"
BLOCK_FLUSHED_HIST, BLOCK_DYNAMIC_RANGE_HIST = "block_flushed_hist", "block_dynamic_range_hist"

#: ``block_scale.kind`` of each block family (the families name what their scales store)
SCALE_KIND_MX = MX.stored_kind
SCALE_KIND_NVFP4 = NVFP4.stored_kind


def int_histogram(values: torch.Tensor) -> dict[str, Any]:
    """``{"min_bin", "counts"}`` of integer-valued ``values`` (empty: min_bin None, no counts)."""
    v = values.reshape(-1).to(torch.int64)
    if v.numel() == 0:
        return {"min_bin": None, "counts": []}
    lo = int(v.min())
    return {"min_bin": lo, "counts": torch.bincount(v - lo).tolist()}


def _summary(values: torch.Tensor) -> tuple[Optional[float], Optional[float], Optional[float]]:
    if values.numel() == 0:
        return None, None, None
    v = values.double()
    std = float(v.std(unbiased=False)) if v.numel() > 1 else 0.0
    return float(v.min()), float(v.max()), std


def block_dict(spec: FormatSpec, block: int, axis_length: int, blocks: int, *,
               live_scales: torch.Tensor, dynamic_range_hist: dict[str, Any],
               clipped: torch.Tensor, flushed: torch.Tensor) -> dict[str, Any]:
    """The block numbers of the module docstring from the per-block arrays: the scales of the
    live blocks (MX: E8M0 exponents; NVFP4: E4M3 scale values), the dynamic-range histogram,
    and per block the count of clipped and of flushed elements."""
    family = family_of(spec)
    kind, binned = family.stored_kind, family.stored_bins(live_scales)
    lo, hi, std = _summary(live_scales)
    return {
        BLOCK_SIZE: block, AXIS_LENGTH: int(axis_length), BLOCKS: int(blocks),
        SHORT_AXIS: bool(axis_length < block),
        BLOCK_SCALE: {"kind": kind, "min": lo, "max": hi, "std": std,
                      "hist": int_histogram(binned)},
        BLOCK_CLIPPED_HIST: torch.bincount(clipped.reshape(-1).long()).tolist(),
        BLOCK_FLUSHED_HIST: torch.bincount(flushed.reshape(-1).long()).tolist(),
        BLOCK_DYNAMIC_RANGE_HIST: dynamic_range_hist,
    }


def element_dict(axis: int, sqnr_db: float, rel_error: float, *, overflow: int, underflow: int,
                 flushed: int, total: int) -> dict[str, Any]:
    """The numbers every format has (module docstring), from the error metrics and counts."""
    return {AXIS: axis, SQNR_DB: sqnr_db, REL_ERROR: rel_error,
            OVERFLOW_RATIO: overflow / total, UNDERFLOW_RATIO: underflow / total,
            FLUSH_RATIO: flushed / total}
