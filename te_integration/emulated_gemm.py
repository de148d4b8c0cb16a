"""The numerics of our custom TE quantizers: operand values per usage and the GEMM over them.

Why this layout: TE keeps a quantized operand in two layouts, ``rowwise`` (the tensor as
[rows, cols]) and ``columnwise`` (its transpose), and a custom quantizer's ``qgemm(a, b)``
computes ``a @ b.T`` on the layouts TE picks per GEMM (fprop: input and weight rowwise; dgrad:
grad_output rowwise, weight columnwise; wgrad: grad_output and input columnwise), so each GEMM
sums over the last axis of both stored operands. Blocking a rowwise layout along its last axis
and a columnwise one along the original's axis 0 is therefore exactly quant.gemm_plan's plan
(``layouts.LAYOUT_GEMM`` says which GEMM each layout feeds; the tests check the axes agree), the plan our
own emulation of megatron-core linears uses. Values are quant.quantize's (dequantized, in the
input's dtype); the GEMM runs in float32 over them and returns ``out_dtype``.

No Transformer Engine import: te_integration.te_quantizer wraps these in TE's classes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from quant import gemm_plan
from quant.vocabulary import is_high_precision

from .layouts import LAYOUT_GEMM

if TYPE_CHECKING:
    from quant.quantizer import Quantizer


def _axis_of(usage: str) -> int:
    """The axis (of the [rows, cols] tensor) a layout's blocks run along: the plan's axis of
    the operand in the GEMM that layout feeds (layouts.LAYOUT_GEMM), the same for every operand."""
    (axis,) = {gemm_plan.axis(gemm, operand) for (operand, lay), gemm in LAYOUT_GEMM.items()
               if lay == usage}
    return axis


#: TE layout -> the axis its blocks run along, derived from LAYOUT_GEMM and quant.gemm_plan
AXIS_OF_USAGE = {usage: _axis_of(usage) for usage in dict.fromkeys(lay for _, lay in LAYOUT_GEMM)}


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """[..., cols] -> [rows, cols] (TE's GEMM view of an operand)."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def layout_quantizer(fmt: str, usage: str) -> Optional[Quantizer]:
    """The quantizer of TE's ``usage`` layout of an operand in ``fmt``: blocks along
    AXIS_OF_USAGE[usage] (built once per format and layout); None for high precision."""
    from quant.quantizer import Quantizer

    return None if is_high_precision(fmt) else Quantizer.of(fmt, axis=AXIS_OF_USAGE[usage])


def usage_values(x2d: torch.Tensor, q: Optional[Quantizer], usage: str) -> torch.Tensor:
    """The operand TE's ``usage`` layout holds: ``x2d`` fake-quantized by ``q`` (quant.quantize
    with the layout's quantizer, :func:`layout_quantizer`; None: high precision), transposed for
    the columnwise layout."""
    import quant

    v = x2d if q is None else quant.quantize(x2d, q)
    return v if usage == "rowwise" else v.t().contiguous()


def hp_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
            bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
            accumulate: bool = False) -> torch.Tensor:
    """``a @ b.T`` (+ bias) in float32 over already fake-quantized operands, as ``out_dtype``;
    ``accumulate`` adds into ``out`` (TE's wgrad accumulation into main_grad)."""
    y = torch.matmul(a.float(), b.float().t())
    if bias is not None and bias.numel():
        y = y + bias.float()
    y = y.to(out_dtype)
    if accumulate:
        if out is None:
            raise ValueError("hp_gemm: accumulate needs out")
        return out.add_(y)
    if out is not None:
        return out.copy_(y)
    return y
