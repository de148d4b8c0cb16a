"""CUSTOM_QUANT_TYPE emulation: fake-quantize GEMM operands with quant.quantize.

Why along the reduction axis: MX hardware scales blocks of 32 consecutive elements of the
dot product, so a block must run along the dimension the GEMM sums over (in-features for
the forward, out-features for dgrad, tokens for wgrad). Per-tensor and element formats
ignore the axis.
"""
from __future__ import annotations

import torch

from .state import STATE


def quantize(x: torch.Tensor, axis: int = -1, fmt: str | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` to ``fmt`` (default: the active CUSTOM_QUANT_TYPE), same shape/dtype."""
    import quant

    name = fmt or STATE.quant_type
    if name is None:
        return x
    return quant.quantize(x, name, axis=axis)


def quantize_ste(x: torch.Tensor, axis: int = -1, fmt: str | None = None) -> torch.Tensor:
    """As :func:`quantize`, with a straight-through gradient (for autograd-tracked operands)."""
    import quant

    name = fmt or STATE.quant_type
    if name is None:
        return x
    return quant.quantize_ste(x, name, axis=axis)
