"""What-if numerics of a captured tensor: quant.whatif for each configured format, along the
reduction axis of the GEMM the tensor feeds (quant.gemm_plan's axis, passed by the hooks as
``quant_axis``), else along the last axis.

Why its own module: the record builder (training thread, device tensors) and the writer (writer
thread, the host copy of a CPU tensor) both compute it, and must store the same thing.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import schema


class WhatifPlan(NamedTuple):
    """What to compute for one tensor: the formats and the axis (and where the axis came from),
    and at most how many elements to analyse (None: all)."""

    formats: tuple[str, ...]
    axis: int
    source: str
    max_elements: int | float | None = None


def plan(formats: tuple[str, ...], tensor: torch.Tensor, variant: str,
         quant_axis: int | None, max_elements: int | float | None = None) -> WhatifPlan | None:
    """The plan of a captured tensor; None when there is nothing to compute (no formats, a
    quantized operand, an empty or non-floating tensor)."""
    if (not formats or variant != schema.VARIANT_HP or tensor.numel() == 0
            or not tensor.is_floating_point()):
        return None
    if quant_axis is None:
        return WhatifPlan(formats, -1, schema.AXIS_LAST, max_elements)
    return WhatifPlan(formats, quant_axis, schema.AXIS_FROM_GEMM, max_elements)


def sample(x: torch.Tensor, axis: int, max_elements: int | float | None) -> torch.Tensor:
    """A strided subset of ``x`` of at most ``max_elements`` elements (when possible), taken
    along the dimensions other than ``axis`` so that every block along ``axis`` stays whole.
    A view: the caller's whole tensor is never copied for it."""
    if max_elements is None or x.dim() < 2 or x.numel() <= max_elements:
        return x
    a = axis % x.dim()
    index: list[slice] = [slice(None)] * x.dim()
    numel = x.numel()
    for d in sorted((d for d in range(x.dim()) if d != a), key=lambda d: -x.shape[d]):
        if numel <= max_elements:
            break
        size = x.shape[d]
        other = numel // size
        step = -(-size // max(1, int(max_elements // other)))
        index[d] = slice(None, None, step)
        numel = other * len(range(0, size, step))
    return x[tuple(index)]


def compute(x: torch.Tensor, p: WhatifPlan) -> dict[str, Any]:
    """The metadata value stored under schema.META_WHATIF."""
    from quant.whatif import whatif_set

    part = sample(x, p.axis, p.max_elements)
    return {schema.WHATIF_AXIS: p.axis, schema.WHATIF_AXIS_SOURCE: p.source,
            schema.WHATIF_ELEMENTS: part.numel(), schema.WHATIF_SAMPLED: part.numel() < x.numel(),
            schema.WHATIF_FORMATS: whatif_set(part, p.formats, p.axis)}
