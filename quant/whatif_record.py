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


def block_dict(spec: FormatSpec, block: int, axis_length: int, blocks: int,
               live_scales: torch.Tensor, dynamic_range_hist: dict[str, Any],
               clipped: torch.Tensor, flushed: torch.Tensor) -> dict[str, Any]:
    """The block numbers of the module docstring from the per-block arrays: the scales of the
    live blocks (MX: E8M0 exponents; NVFP4: E4M3 scale values), the dynamic-range histogram,
    and per block the count of clipped and of flushed elements."""
    family = family_of(spec)
    kind, binned = family.stored_kind, family.stored_bins(live_scales)
    lo, hi, std = _summary(live_scales)
    return {
        "block_size": block, "axis_length": int(axis_length), "blocks": int(blocks),
        "short_axis": bool(axis_length < block),
        "block_scale": {"kind": kind, "min": lo, "max": hi, "std": std,
                        "hist": int_histogram(binned)},
        "block_clipped_hist": torch.bincount(clipped.reshape(-1).long()).tolist(),
        "block_flushed_hist": torch.bincount(flushed.reshape(-1).long()).tolist(),
        "block_dynamic_range_hist": dynamic_range_hist,
    }


def element_dict(axis: int, sqnr_db: float, rel_error: float, overflow: int, underflow: int,
                 flushed: int, total: int) -> dict[str, Any]:
    """The numbers every format has (module docstring), from the error metrics and counts."""
    return {"axis": axis, "sqnr_db": sqnr_db, "rel_error": rel_error,
            "overflow_ratio": overflow / total, "underflow_ratio": underflow / total,
            "flush_ratio": flushed / total}
