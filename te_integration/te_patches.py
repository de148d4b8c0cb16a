"""Two calls of Transformer Engine's that cannot take a custom quantizer, made to take ours.

Why: driving TE's real Linear under the custom recipe shows two places where TE (2.16-2.20)
hands our quantizer's tensors to code written only for its own quantizers:

- **fused weight-gradient accumulation** (Megatron-LM's default,
  ``fuse_wgrad_accumulation=config.gradient_accumulation_fusion``): the wgrad GEMM is asked to
  write into ``main_grad`` (``out=main_grad, accumulate=True``) and TE then tells Megatron's DDP
  the gradient is already there (``grad_added_to_main_grad``); TE's ``custom_gemm`` drops
  ``out`` and ``accumulate``, so ``main_grad`` never got the gradient. ``_honour_out`` adds
  (or copies) the result into ``out`` for GEMMs over our tensors, as TE's cuBLAS path does.
- **a bias** (Megatron's ``add_bias_linear`` default, a QKV bias): TE's backward fuses the bias
  gradient with quantizing grad_output in ``tex.bgrad_quantize``, whose C++ accepts only TE's
  own quantizers. ``_bgrad_quantize`` computes, for our quantizer, what TE's unfused path does
  (the bias gradient as the unquantized sum over tokens, then grad_output quantized) and hands
  every other quantizer to TE's function unchanged.

``install()`` wraps both once per process (the factory calls it before its first quantizer);
``missing()`` says which of the two places this TE does not have, so the factory's ``--check``
refuses before a run instead of training wrong. Imports TE.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

import torch

#: module holding the name general_gemm calls for custom tensors, and that name
GEMM_DISPATCH = ("transformer_engine.pytorch.cpp_extensions.gemm", "custom_gemm")
#: the compiled extension's fused bias-gradient + quantize
BGRAD_QUANTIZE = ("transformer_engine_torch", "bgrad_quantize")
_MARK = "_lowp_wrapped"


def _is_ours(obj: Any) -> bool:
    from .te_quantizer import EmulatedQuantizer, EmulatedTensor

    return isinstance(obj, (EmulatedQuantizer, EmulatedTensor))


def _honour_out(custom_gemm: Callable) -> Callable:
    signature = inspect.signature(custom_gemm)

    @functools.wraps(custom_gemm)
    def wrapped(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        result = custom_gemm(*args, **kwargs)
        out = bound.arguments.get("out")
        ours = _is_ours(bound.arguments.get("A")) or _is_ours(bound.arguments.get("B"))
        if out is None or not ours:
            return result
        y, *rest = result
        if bound.arguments.get("accumulate", False):
            out.add_(y.to(out.dtype))
        else:
            out.copy_(y)
        return (out, *rest)

    setattr(wrapped, _MARK, True)
    return wrapped


def _bgrad_quantize(bgrad_quantize: Callable) -> Callable:
    def wrapped(grad_output: torch.Tensor, quantizer: Any, *args: Any, **kwargs: Any):
        if not _is_ours(quantizer):
            return bgrad_quantize(grad_output, quantizer, *args, **kwargs)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        return [grad_bias, quantizer(grad_output)]

    wrapped.__doc__ = "TE's bgrad_quantize; for our quantizer the bias gradient and quantize unfused."
    setattr(wrapped, _MARK, True)
    return wrapped


_PATCHES: dict[tuple[str, str], Callable[[Callable], Callable]] = {
    GEMM_DISPATCH: _honour_out,
    BGRAD_QUANTIZE: _bgrad_quantize,
}
#: what each place breaks, for the refusal line (the Megatron-LM flag that avoids it)
AVOIDED_BY = {
    GEMM_DISPATCH: "fused weight-gradient accumulation (pass --no-gradient-accumulation-fusion)",
    BGRAD_QUANTIZE: "a linear bias (pass --disable-bias-linear, and no --add-qkv-bias)",
}


def _target(place: tuple[str, str]) -> Any:
    try:
        return getattr(importlib.import_module(place[0]), place[1], None)
    except Exception:
        return None


def missing() -> list[str]:
    """The places this TE lacks (each as what it breaks and the flag that avoids it)."""
    return [AVOIDED_BY[p] for p in _PATCHES if not callable(_target(p))]


def install() -> None:
    """Wrap both places (idempotent; a place this TE lacks is left alone: ``missing``)."""
    for place, wrap in _PATCHES.items():
        current = _target(place)
        if callable(current) and not getattr(current, _MARK, False):
            setattr(importlib.import_module(place[0]), place[1], wrap(current))
