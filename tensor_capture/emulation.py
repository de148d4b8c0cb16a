"""CUSTOM_QUANT_TYPE emulation: fake-quantize GEMM operands with quant.quantize.

Why along the reduction axis: MX hardware scales blocks of 32 consecutive elements of the
dot product, so a block must run along the dimension the GEMM sums over (in-features for
the forward, out-features for dgrad, tokens for wgrad). The callers (tensor_capture.hooks)
take each operand's axis from quant.gemm_plan, the plan precision-diff uses too.
Per-tensor and element formats ignore the axis.

``kind`` names the operand ("linear forward input", ...) for the pre-quantization underflow
warning (:mod:`tensor_capture.underflow`), which runs only while ``STATE.warn_underflow``.
"""
from __future__ import annotations

import torch

from .state import STATE


def quantize(x: torch.Tensor, axis: int = -1, fmt: str | None = None, *, kind: str | None = None,
             site: str | None = None, iteration: int | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` to ``fmt`` (default: the active CUSTOM_QUANT_TYPE), same shape/dtype."""
    import quant

    name = fmt or STATE.quant_type
    if name is None:
        return x
    q = quant.quantize(x, name, axis=axis)
    if STATE.warn_underflow and kind is not None:
        from . import underflow

        underflow.check(x, q, name, axis, kind, site, iteration)
    return q


def quantize_ste(x: torch.Tensor, axis: int = -1, fmt: str | None = None, *,
                 kind: str | None = None, site: str | None = None,
                 iteration: int | None = None) -> torch.Tensor:
    """As :func:`quantize`, with a straight-through gradient (for autograd-tracked operands)."""
    import quant

    name = fmt or STATE.quant_type
    if name is None:
        return x
    q = quant.quantize_ste(x, name, axis=axis)
    if STATE.warn_underflow and kind is not None:
        from . import underflow

        underflow.check(x, q, name, axis, kind, site, iteration)
    return q
