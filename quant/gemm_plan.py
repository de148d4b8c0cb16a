"""The GEMM-operand quantization plan: which operand of which GEMM is blocked along which axis.

Why one table: a block-scaled format (MX, NVFP4) scales blocks of consecutive elements of
the dot product, so each operand must be blocked along the dimension its GEMM sums over.
A linear layer ``y = x @ W.T`` (x: [..., in], W: [out, in]) runs three GEMMs:

==========  ===================  ===========================  ========================
GEMM        computes             operands (axis)              reduces over
==========  ===================  ===========================  ========================
fprop       y = x @ W.T          input (-1), weight (-1)      in-features
dgrad       dx = dy @ W          grad_output (-1), weight (0) out-features
wgrad       dW = dy2.T @ x2      grad_output (0), input (0)   tokens (2-D: [tokens, .])
==========  ===================  ===========================  ========================

and attention two: Q·Kᵀ (query and key along head_dim, the last axis) and P·V (probs along
its last axis, the key sequence; value along axis 0, the key sequence of Megatron's
[sk, b, groups, head_dim]). The GEMM names are Transformer Engine's (and the precision plans'
and recipes'); "forward", an older name of fprop, is accepted where a caller names a GEMM
(:func:`gemm_name`). Training emulation (tensor_capture.hooks) and precision-diff
(training_profiler.lowp_emulation) both quantize through this table and compute the linear
GEMMs with the functions below, so a format means the same numbers in both.

Numerics only: torch and quant, nothing of capture, training or Megatron.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .vocabulary import LINEAR_GEMMS, is_high_precision

__all__ = ["OperandPlan", "PLAN", "GEMM_OPERANDS", "LINEAR_GEMMS", "gemm_name", "axis", "plan",
           "QuantizeOperand",
           "quantize_operands", "linear_forward", "linear_dgrad", "linear_wgrad",
           "wgrad_2d", "format_quantizer", "EmulatedLinear", "emulated_linear"]


@dataclass(frozen=True)
class OperandPlan:
    """One GEMM operand: the GEMM, the operand's name, the axis its blocks run along."""

    gemm: str        # "fprop" | "dgrad" | "wgrad" (linear), "qk" | "pv" (attention)
    operand: str     # "input" | "weight" | "grad_output" | "query" | "key" | "probs" | "value"
    axis: int
    reduces_over: str


#: The plan, in each GEMM's operand order (the order the operands are quantized in).
PLAN: tuple[OperandPlan, ...] = (
    OperandPlan("fprop", "input", -1, "in-features"),
    OperandPlan("fprop", "weight", -1, "in-features"),
    OperandPlan("dgrad", "grad_output", -1, "out-features"),
    OperandPlan("dgrad", "weight", 0, "out-features"),
    OperandPlan("wgrad", "grad_output", 0, "tokens"),
    OperandPlan("wgrad", "input", 0, "tokens"),
    OperandPlan("qk", "query", -1, "head_dim"),
    OperandPlan("qk", "key", -1, "head_dim"),
    OperandPlan("pv", "probs", -1, "key sequence"),
    OperandPlan("pv", "value", 0, "key sequence"),
)
_BY_KEY = {(p.gemm, p.operand): p for p in PLAN}
#: gemm -> its operands' plans, in order
GEMM_OPERANDS: dict[str, tuple[OperandPlan, ...]] = {}
for _p in PLAN:
    GEMM_OPERANDS[_p.gemm] = GEMM_OPERANDS.get(_p.gemm, ()) + (_p,)
#: names accepted for a GEMM besides its own (callers' older spelling)
_GEMM_ALIASES = {"forward": "fprop"}


def gemm_name(gemm: str) -> str:
    """The plan's name of a GEMM a caller names ("forward" -> "fprop"; others unchanged)."""
    return _GEMM_ALIASES.get(gemm, gemm)


def plan(gemm: str, operand: str) -> OperandPlan:
    """The plan entry of ``operand`` in ``gemm`` (KeyError names the known pairs)."""
    try:
        return _BY_KEY[(gemm_name(gemm), operand)]
    except KeyError:
        raise KeyError(f"no GEMM operand {gemm}/{operand}; known: "
                       f"{sorted(f'{g}/{o}' for g, o in _BY_KEY)}") from None


def axis(gemm: str, operand: str) -> int:
    """The axis ``operand`` of ``gemm`` is blocked along (its GEMM's reduction axis)."""
    return plan(gemm, operand).axis


#: a function, not a quantizer: (tensor, plan entry) -> the fake-quantized tensor (same shape and
#: dtype), what a GEMM's operands go through; :func:`format_quantizer` makes one from
#: quant.quantizer.Quantizer values (one per format, moved to the plan entry's axis), training
#: emulation's adds its recipe
QuantizeOperand = Callable[[torch.Tensor, OperandPlan], torch.Tensor]


def quantize_operands(gemm: str, tensors: tuple[torch.Tensor, ...],
                      quantize: Optional[QuantizeOperand]) -> tuple[torch.Tensor, ...]:
    """``tensors`` (in the plan's operand order of ``gemm``) through ``quantize``; None: as is."""
    if quantize is None:
        return tensors
    plans = GEMM_OPERANDS[gemm_name(gemm)]
    if len(plans) != len(tensors):
        raise ValueError(f"GEMM {gemm} has {len(plans)} operands, got {len(tensors)}")
    return tuple(quantize(t, p) for t, p in zip(tensors, plans))


# -- the three GEMMs of a linear layer (the same ops, in the same order, as megatron-core's
#    LinearWithGradAccumulationAndAsyncCommunication, so an unquantized run is bit-identical)
def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   quantize: Optional[QuantizeOperand] = None) -> torch.Tensor:
    """x @ weight.T (+ bias) on the forward operands."""
    a, w = quantize_operands("fprop", (x, weight), quantize)
    out = torch.matmul(a, w.t())
    if bias is not None:
        out = out + bias
    return out


def linear_dgrad(grad_output: torch.Tensor, weight: torch.Tensor,
                 quantize: Optional[QuantizeOperand] = None) -> torch.Tensor:
    """grad_output @ weight: the input gradient, on the dgrad operands."""
    g, w = quantize_operands("dgrad", (grad_output, weight), quantize)
    return g.matmul(w)


def wgrad_2d(grad_output: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, features] views of the wgrad operands (megatron-core's flattening)."""
    grad_output, x = grad_output.contiguous(), x.contiguous()
    if grad_output.dim() > 2:
        grad_output = grad_output.view(-1, grad_output.shape[-1])
        x = x.view(-1, x.shape[-1])
    return grad_output, x


def linear_wgrad(grad_output: torch.Tensor, x: torch.Tensor,
                 quantize: Optional[QuantizeOperand] = None) -> torch.Tensor:
    """grad_output.T @ x of the 2-D operands: the weight gradient, on the wgrad operands."""
    g, a = quantize_operands("wgrad", (grad_output, x), quantize)
    return g.t().matmul(a)


def format_quantizer(fmt: str, grad_fmt: Optional[str] = None) -> QuantizeOperand:
    """Input and weight operands in ``fmt``, grad_output operands in ``grad_fmt`` (default
    ``fmt``; a high-precision name of quant.vocabulary, "fp32" among them: left unquantized),
    each along its plan axis: quant.quantize with one quant.quantizer.Quantizer per format,
    built here once."""
    import quant  # lazy: quant's torch modules load on first use
    from quant.quantizer import Quantizer

    fake_quantize = quant.quantize
    grad_fmt = grad_fmt or fmt
    quantizers = {name: Quantizer.of(name) for name in {fmt, grad_fmt}
                  if not is_high_precision(name)}

    def q(t: torch.Tensor, p: OperandPlan) -> torch.Tensor:
        config = quantizers.get(grad_fmt if p.operand == "grad_output" else fmt)
        return t if config is None else fake_quantize(t, config.along(p.axis))

    return q


class EmulatedLinear(torch.autograd.Function):
    """y = x @ W.T + b whose forward, dgrad and wgrad GEMMs each see their operands quantized
    along the plan's axes (the bias gradient is the unquantized sum, as in megatron-core)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                quantize: Optional[QuantizeOperand]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.quantize = quantize
        ctx.use_bias = bias is not None
        return linear_forward(x, weight, bias, quantize)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = linear_dgrad(grad_output, weight, ctx.quantize) if need_x else None
        grad_w = grad_b = None
        if need_w or (need_b and ctx.use_bias):
            g2, x2 = wgrad_2d(grad_output, x)
            if need_w:
                grad_w = linear_wgrad(g2, x2, ctx.quantize)
            if need_b and ctx.use_bias:
                grad_b = g2.sum(dim=0)
        return grad_x, grad_w, grad_b, None


def emulated_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    fmt: str, grad_fmt: Optional[str] = None) -> torch.Tensor:
    """A linear layer in ``fmt`` (see :class:`EmulatedLinear`, :func:`format_quantizer`)."""
    return EmulatedLinear.apply(x, weight, bias, format_quantizer(fmt, grad_fmt))
