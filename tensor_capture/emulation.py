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


class _QuantizeSTE(torch.autograd.Function):
    """Quantize in the forward; pass the gradient straight through (for autograd-tracked operands)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: int, fmt: str | None) -> torch.Tensor:  # type: ignore[override]
        return quantize(x, axis, fmt)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None


def quantize_ste(x: torch.Tensor, axis: int = -1, fmt: str | None = None) -> torch.Tensor:
    if x.requires_grad and torch.is_grad_enabled():
        return _QuantizeSTE.apply(x, axis, fmt)
    return quantize(x, axis, fmt)
