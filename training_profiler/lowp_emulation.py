"""Low-precision emulation of Linear layers on any nn.Module, by hooks (no model copy).

Why hooks: the layer-wise diff must run the same weights in fp32 and in a CUSTOM_QUANT_TYPE
format without a second copy of the model (it must fit where the model does not fit twice) and
without the Megatron patch set. For every Linear-like module, a forward pre-hook quantizes the
input and swaps in a quantized view of the weight (straight-through gradient to the real
parameter); the forward hook puts the parameter back and makes the output's gradient pass
through the quantizer in backward, so both GEMM directions see low-precision operands.
Modes named ``autocast_bf16`` / ``autocast_fp16`` use torch.autocast instead.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
import torch

from training_profiler._tensors import first_tensor

# Megatron's tensor-parallel linears (local spec) and TE's, recognised by class name so this
# module never imports Megatron.
_LINEAR_CLASS_NAMES = {"ColumnParallelLinear", "RowParallelLinear", "TELinear", "TEColumnParallelLinear",
                       "TERowParallelLinear", "Linear"}
AUTOCAST_MODES = {"autocast_bf16": torch.bfloat16, "autocast_fp16": torch.float16}


def is_linear(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) or type(module).__name__ in _LINEAR_CLASS_NAMES) \
        and isinstance(w, torch.nn.Parameter) and w.dim() == 2


@contextlib.contextmanager
def emulate_linears(model: torch.nn.Module, fmt: str, grad_fmt: str | None = None) -> Iterator[list[str]]:
    """Inside the block, every Linear-like module of ``model`` computes with ``fmt`` operands
    (input and weight quantized in forward, output gradient quantized with ``grad_fmt``,
    default ``fmt``, in backward). Yields the names of the emulated modules."""
    import quant

    quant.get_format(fmt)  # fail early, with quant's message, on an unknown name
    grad_fmt = grad_fmt or fmt
    if grad_fmt != "fp32":
        quant.get_format(grad_fmt)
    handles, saved, names = [], {}, []

    def pre(module, args, kwargs):
        w = module._parameters["weight"]
        saved[id(module)] = w
        module._parameters["weight"] = quant.quantize_ste(w, fmt)
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            args = (quant.quantize_ste(args[0], fmt),) + tuple(args[1:])
        return args, kwargs

    def post(module, args, kwargs, output):
        module._parameters["weight"] = saved.pop(id(module))
        t = first_tensor(output)
        if grad_fmt != "fp32" and t is not None and t.requires_grad:
            # The gradient arriving at this output is quantized before it flows into the GEMMs.
            t.register_hook(lambda g: quant.quantize(g, grad_fmt))
        return output

    try:
        for name, m in model.named_modules():
            if is_linear(m):
                names.append(name)
                handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(m.register_forward_hook(post, with_kwargs=True))
        yield names
    finally:
        for h in handles:
            h.remove()
        for name, m in model.named_modules():  # a forward that raised leaves a swapped weight
            if id(m) in saved:
                m._parameters["weight"] = saved.pop(id(m))


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
