"""What the patched Megatron code calls when ``STATE.active`` is true.

The patched autograd Function of ``tensor_parallel/layers.py`` calls ``linear_forward``,
``linear_dgrad``, ``linear_wgrad`` and ``linear_backward_post``; the patched
``DotProductAttention.forward`` calls ``attention_forward`` and, for P·V, ``quantize_probs``.
Each computes exactly what the unpatched code computes (same ops, same order) unless a
format is being emulated, and captures through the process-wide saver.

Module paths and layer indexes: a global forward pre-hook (installed only while capture
is enabled) sees the outermost module first, records every sub-module's path once, and
tells the linear Function which linear module is running. ``layer_idx`` is 0-based: the
owning TransformerLayer's ``layer_number - 1``, i.e. the ``decoder.layers.{i}`` index when
there is no pipeline parallelism.
"""
from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import emulation, schema
from .saver import get_tensor_saver
from .state import STATE

LINEAR_CLASSES = frozenset({"ColumnParallelLinear", "RowParallelLinear"})
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Site:
    """Where a module sits in the model."""

    module_path: str | None
    submodule: str | None
    layer_idx: int | None


UNKNOWN_SITE = Site(None, None, None)
_SITES: "weakref.WeakKeyDictionary[torch.nn.Module, Site]" = weakref.WeakKeyDictionary()
_HOOK: list[Any] = []


def _strip(path: str) -> str:
    while path.startswith("module."):
        path = path[len("module."):]
    return path


def register_model(root: torch.nn.Module, prefix: str = "") -> None:
    """Record the path and 0-based layer index of every sub-module of ``root``."""
    layer_of: dict[str, int | None] = {}
    for name, mod in root.named_modules(prefix=prefix):
        path = _strip(name)
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        idx = layer_of.get(parent)
        number = getattr(mod, "layer_number", None)
        if type(mod).__name__.endswith("TransformerLayer") and isinstance(number, int):
            idx = number - 1
        elif idx is None:
            m = _LAYER_RE.search(path)
            idx = int(m.group(1)) if m else None
        layer_of[path] = idx
        leaf = path.rsplit(".", 1)[-1] if path else type(mod).__name__
        _SITES[mod] = Site(path or None, leaf, idx)


def site_of(module: torch.nn.Module) -> Site:
    return _SITES.get(module, UNKNOWN_SITE)


def _discover(module: torch.nn.Module, args: Any) -> None:
    site = _SITES.get(module)
    if site is None:                 # first call of an unseen root: map its whole tree
        register_model(module)
        site = _SITES.get(module, UNKNOWN_SITE)
    if type(module).__name__ in LINEAR_CLASSES:
        STATE.current_linear = site


def install_discovery() -> None:
    if not _HOOK:
        _HOOK.append(torch.nn.modules.module.register_module_forward_pre_hook(_discover))


def uninstall_discovery() -> None:
    while _HOOK:
        _HOOK.pop().remove()


# -- linear ------------------------------------------------------------------------------------------
@dataclass
class _LinearCall:
    site: Site
    iteration: int
    sample_idx: int | None
    capture_bwd: bool


def _save(saver, t, layer_type, op, phase, name, site, it, sample, component, variant=schema.VARIANT_HP,
          axis=None):
    saver.save_tensor(t, layer_type, op, None, name, site.layer_idx, phase, component, None, sample,
                      it, module_path=site.module_path, submodule=site.submodule, variant=variant,
                      quant_axis=axis)


def _wanted(saver, layer_type, op, phase, name, site, it) -> bool:
    return saver.should_capture(layer_type, op, phase, name, site.layer_idx, site.module_path, it)


def linear_forward(ctx: Any, total_input: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """input @ weight.t() (+ bias), on fake-quantized operands when emulating; captures."""
    saver = get_tensor_saver()
    site = STATE.current_linear or UNKNOWN_SITE
    it, sample = saver.iteration, saver.sample_idx
    cap = saver.enabled
    ctx._tc = _LinearCall(site, it, sample, cap)
    if cap:
        for name, t in (("input", total_input), ("weight", weight)):
            if _wanted(saver, "linear", "forward", "pre", name, site, it):
                _save(saver, t, "linear", "forward", "pre", name, site, it, sample, "linear",
                      axis=-1)
    a, w = total_input, weight
    if STATE.emulate:
        a = emulation.quantize(total_input, axis=-1)   # reduction dim: in-features
        w = emulation.quantize(weight, axis=-1)
        if cap and saver.config.save_quantized:
            for name, t in ((schema.quantized_name("input"), a), (schema.quantized_name("weight"), w)):
                if _wanted(saver, "linear", "forward", "pre", name, site, it):
                    _save(saver, t, "linear", "forward", "pre", name, site, it, sample, "linear",
                          schema.VARIANT_QUANTIZED)
    output = torch.matmul(a, w.t())
    if bias is not None:
        output = output + bias
    if cap and _wanted(saver, "linear", "forward", "post", "output", site, it):
        _save(saver, output, "linear", "forward", "post", "output", site, it, sample, "linear")
    return output


def _call(ctx: Any) -> _LinearCall:
    call = getattr(ctx, "_tc", None)
    if call is None:
        saver = get_tensor_saver()
        call = _LinearCall(UNKNOWN_SITE, saver.iteration, saver.sample_idx, saver.enabled)
    return call


def linear_dgrad(ctx: Any, grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad_output @ weight, quantized along the out-features (reduction) dim when emulating."""
    call = _call(ctx)
    saver = get_tensor_saver()
    cap = call.capture_bwd and saver.enabled
    site, it, sample = call.site, call.iteration, call.sample_idx
    if cap:
        for name, t, axis in (("grad_output", grad_output, -1), ("weight", weight, 0)):
            if _wanted(saver, "linear", "backward", "pre", name, site, it):
                _save(saver, t, "linear", "backward", "pre", name, site, it, sample, "linear",
                      axis=axis)
    g, w = grad_output, weight
    if STATE.emulate:
        g = emulation.quantize(grad_output, axis=-1)
        w = emulation.quantize(weight, axis=0)
        if cap and saver.config.save_quantized:
            for name, t in ((schema.quantized_name("grad_output"), g), (schema.quantized_name("weight"), w)):
                if _wanted(saver, "linear", "backward", "pre", name, site, it):
                    _save(saver, t, "linear", "backward", "pre", name, site, it, sample, "linear",
                          schema.VARIANT_QUANTIZED)
    return g.matmul(w)


def linear_wgrad(ctx: Any, grad_output: torch.Tensor, total_input: torch.Tensor) -> torch.Tensor:
    """grad_output.t() @ input (2-D), both quantized along the token (reduction) dim when emulating."""
    if not STATE.emulate:
        return grad_output.t().matmul(total_input)
    g = emulation.quantize(grad_output, axis=0)
    a = emulation.quantize(total_input, axis=0)
    call = _call(ctx)
    saver = get_tensor_saver()
    if call.capture_bwd and saver.enabled and saver.config.save_quantized:
        for name, t in ((schema.quantized_name("grad_output", wgrad=True), g),
                        (schema.quantized_name("input", wgrad=True), a)):
            if _wanted(saver, "linear", "backward", "pre", name, call.site, call.iteration):
                _save(saver, t, "linear", "backward", "pre", name, call.site, call.iteration,
                      call.sample_idx, "linear", schema.VARIANT_QUANTIZED)
    return g.t().matmul(a)


def linear_backward_post(ctx: Any, grad_input: torch.Tensor | None,
                         grad_weight: torch.Tensor | None) -> None:
    """Capture grad_input (after the tensor-parallel all-reduce) and grad_weight."""
    call = _call(ctx)
    saver = get_tensor_saver()
    if not (call.capture_bwd and saver.enabled):
        return
    for name, t in (("grad_input", grad_input), ("grad_weight", grad_weight)):
        if t is not None and _wanted(saver, "linear", "backward", "post", name, call.site,
                                     call.iteration):
            _save(saver, t, "linear", "backward", "post", name, call.site, call.iteration,
                  call.sample_idx, "linear")


# -- attention ---------------------------------------------------------------------------------------
def _attention_site(module: torch.nn.Module) -> Site:
    site = _SITES.get(module)
    number = getattr(module, "layer_number", None)
    idx = number - 1 if isinstance(number, int) else None
    if site is None:
        return Site(None, "core_attention", idx)
    if isinstance(number, int) and site.layer_idx != idx:
        return Site(site.module_path, site.submodule, idx)
    return site


def _grad_hook(saver, name: str, phase: str, site: Site, it: int, sample: int | None):
    def hook(grad: torch.Tensor) -> None:
        if saver.enabled:
            _save(saver, grad, "attention", "backward", phase, name, site, it, sample, "FA")
    return hook


def attention_forward(module: torch.nn.Module, forward: Callable[..., torch.Tensor],
                      query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      *args: Any, **kwargs: Any) -> torch.Tensor:
    """Run ``forward`` (the unpatched DotProductAttention.forward) with capture and emulation."""
    return _attention(module, forward, query, key, value, True, args, kwargs)


def te_attention_forward(module: torch.nn.Module, forward: Callable[..., torch.Tensor],
                         query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         *args: Any, **kwargs: Any) -> torch.Tensor:
    """TEDotProductAttention: capture only (TE's fused kernel cannot be emulated from Python)."""
    return _attention(module, forward, query, key, value, False, args, kwargs)


def _attention(module, forward, query, key, value, emulate, args, kwargs):
    saver = get_tensor_saver()
    cap = saver.enabled
    site = _attention_site(module) if cap else UNKNOWN_SITE
    it, sample = saver.iteration, saver.sample_idx
    if cap:
        for name, t, axis in (("query", query, -1), ("key", key, -1), ("value", value, 0)):
            if _wanted(saver, "attention", "forward", "pre", name, site, it):
                _save(saver, t, "attention", "forward", "pre", name, site, it, sample, "FA",
                      axis=axis if emulate and STATE.emulate_attention else None)
            if t.requires_grad and _wanted(saver, "attention", "backward", "post", "grad_" + name,
                                           site, it):
                t.register_hook(_grad_hook(saver, "grad_" + name, "post", site, it, sample))
    if emulate and STATE.emulate_attention:
        # Q·Kᵀ reduces over head_dim (last axis of q and k); P·V reduces over the key
        # sequence (axis 0 of v, [sk, b, groups, head_dim]); P is quantized in the forward.
        query = emulation.quantize_ste(query, axis=-1)
        key = emulation.quantize_ste(key, axis=-1)
        value = emulation.quantize_ste(value, axis=0)
        if cap and saver.config.save_quantized:
            for name, t in ((schema.quantized_name("query"), query), (schema.quantized_name("key"), key),
                            (schema.quantized_name("value"), value)):
                if _wanted(saver, "attention", "forward", "pre", name, site, it):
                    _save(saver, t, "attention", "forward", "pre", name, site, it, sample, "FA",
                          schema.VARIANT_QUANTIZED)
    context = forward(query, key, value, *args, **kwargs)
    if cap:
        if _wanted(saver, "attention", "forward", "post", "context", site, it):
            _save(saver, context, "attention", "forward", "post", "context", site, it, sample, "FA")
        if context.requires_grad and _wanted(saver, "attention", "backward", "pre", "grad_context",
                                             site, it):
            context.register_hook(_grad_hook(saver, "grad_context", "pre", site, it, sample))
    return context


def quantize_probs(attention_probs: torch.Tensor) -> torch.Tensor:
    """P of P·V, fake-quantized along the key axis (its reduction dim), gradient passed through."""
    return emulation.quantize_ste(attention_probs, axis=-1)
