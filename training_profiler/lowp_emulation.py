"""Low-precision emulation of Linear layers on any nn.Module, in place (no model copy).

Why the training's GEMMs: precision-diff must measure the format the training emulation
(CUSTOM_QUANT_TYPE in a patched Megatron) uses, so every Linear-like module computes through
quant.gemm_plan.EmulatedLinear, the same three GEMMs on the same plan: forward (input and
weight along in-features), dgrad (grad_output and weight along out-features), wgrad
(grad_output and input along tokens). Inside the block an nn.Linear's ``forward`` and a
Megatron Column/RowParallelLinear's ``_forward_impl`` are instance attributes calling it;
both are removed on exit. No second copy of the model (it must fit where the model does not
fit twice), no Megatron patch set. Modes named ``autocast_bf16`` / ``autocast_fp16`` use
torch.autocast instead.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from quant import gemm_plan
from tensor_capture.sites import LINEAR_CLASSES as _MEGATRON_LINEARS

# Megatron's tensor-parallel linears (local spec, _MEGATRON_LINEARS) are recognised by class
# name so this module never imports Megatron; their GEMMs run in ``_forward_impl``.
# Transformer Engine's: their GEMMs run inside TE's kernels, which cannot be emulated.
_TE_LINEARS = {"TELinear", "TEColumnParallelLinear", "TERowParallelLinear",
               "TELayerNormColumnParallelLinear"}
AUTOCAST_MODES = {"autocast_bf16": torch.bfloat16, "autocast_fp16": torch.float16}
_MISSING = object()


def _kind(module: torch.nn.Module) -> str | None:
    """'torch' | 'megatron' | 'te' for a Linear-like module with a 2-D weight, else None."""
    w = getattr(module, "weight", None)
    if not (isinstance(w, torch.nn.Parameter) and w.dim() == 2):
        return None
    name = type(module).__name__
    if name in _TE_LINEARS or type(module).__module__.startswith("transformer_engine"):
        return "te"
    if isinstance(module, torch.nn.Linear):
        return "torch"
    return "megatron" if name in _MEGATRON_LINEARS else None


def is_linear(module: torch.nn.Module) -> bool:
    return _kind(module) is not None


def _torch_forward(module: torch.nn.Linear, quantize: gemm_plan.QuantizeOperand,
                   input: torch.Tensor) -> torch.Tensor:
    return gemm_plan.EmulatedLinear.apply(input, module.weight, module.bias, quantize)


def _megatron_impl(quantize: gemm_plan.QuantizeOperand, input: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None, *args: Any, allreduce_dgrad: bool = False,
                   sequence_parallel: bool = False, **kwargs: Any) -> torch.Tensor:
    """megatron-core's linear_with_grad_accumulation_and_async_allreduce at tensor-parallel
    size 1 (gradient_accumulation_fusion does not apply: precision-diff never touches .grad)."""
    if allreduce_dgrad or sequence_parallel:
        raise ValueError("format emulation of Megatron linears needs tensor-parallel size 1 "
                         "without sequence parallelism (run precision-diff on one rank)")
    return gemm_plan.EmulatedLinear.apply(input, weight, bias, quantize)


def _patch(module: torch.nn.Module, kind: str, quantize: gemm_plan.QuantizeOperand, where: str,
           done: list[tuple[torch.nn.Module, str, Any]]) -> None:
    if kind == "te":
        raise ValueError(f"{where or type(module).__name__}: a Transformer Engine linear; its GEMMs "
                         "run inside TE and cannot be emulated like the training emulation "
                         "(build the model with the local spec)")
    if kind == "torch" and type(module).forward is not torch.nn.Linear.forward:
        raise ValueError(f"{where or type(module).__name__}: {type(module).__name__} overrides "
                         "nn.Linear.forward, so its GEMMs cannot be emulated")
    attr, fn = (("forward", partial(_torch_forward, module, quantize)) if kind == "torch"
                else ("_forward_impl", partial(_megatron_impl, quantize)))
    done.append((module, attr, module.__dict__.get(attr, _MISSING)))
    setattr(module, attr, fn)


@contextlib.contextmanager
def emulate_linears(model: torch.nn.Module, fmt: str, grad_fmt: str | None = None) -> Iterator[list[str]]:
    """Inside the block, every Linear-like module of ``model`` computes its forward, dgrad and
    wgrad GEMMs as the training emulation does (quant.gemm_plan), inputs and weights in
    ``fmt``, output gradients in ``grad_fmt`` (default ``fmt``; "fp32": unquantized). Yields
    the names of the emulated modules."""
    import quant

    quant.get_format(fmt)  # fail early, with quant's message, on an unknown name
    if grad_fmt is not None and grad_fmt != "fp32":
        quant.get_format(grad_fmt)
    quantize = gemm_plan.format_quantizer(fmt, grad_fmt)
    done: list[tuple[torch.nn.Module, str, Any]] = []
    names: list[str] = []
    try:
        for name, m in model.named_modules():
            kind = _kind(m)
            if kind is not None:
                _patch(m, kind, quantize, name, done)
                names.append(name)
        yield names
    finally:
        for m, attr, old in reversed(done):
            if old is _MISSING:
                delattr(m, attr)       # the class's method again
            else:
                setattr(m, attr, old)


@contextlib.contextmanager
def precision(model: torch.nn.Module, mode: str) -> Iterator[None]:
    """One context for every supported mode: 'fp32' (nothing), 'autocast_bf16'/'autocast_fp16',
    or any quant format name (emulated on Linear layers)."""
    if mode == "fp32":
        yield
    elif mode in AUTOCAST_MODES:
        p = next(iter(model.parameters()), None)
        device_type = p.device.type if p is not None else "cpu"
        with torch.autocast(device_type, dtype=AUTOCAST_MODES[mode]):
            yield
    else:
        with emulate_linears(model, mode):
            yield
