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
    """What to compute for one tensor: the formats and the axis (and where the axis came from)."""

    formats: tuple[str, ...]
    axis: int
    source: str


def plan(formats: tuple[str, ...], tensor: torch.Tensor, variant: str,
         quant_axis: int | None) -> WhatifPlan | None:
    """The plan of a captured tensor; None when there is nothing to compute (no formats, a
    quantized operand, an empty or non-floating tensor)."""
    if (not formats or variant != schema.VARIANT_HP or tensor.numel() == 0
            or not tensor.is_floating_point()):
        return None
    if quant_axis is None:
        return WhatifPlan(formats, -1, schema.AXIS_LAST)
    return WhatifPlan(formats, quant_axis, schema.AXIS_FROM_GEMM)


def compute(x: torch.Tensor, p: WhatifPlan) -> dict[str, Any]:
    """The metadata value stored under schema.META_WHATIF."""
    from quant.whatif import whatif_set

    return {schema.WHATIF_AXIS: p.axis, schema.WHATIF_AXIS_SOURCE: p.source,
            schema.WHATIF_FORMATS: whatif_set(x, p.formats, p.axis)}
