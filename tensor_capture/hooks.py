"""What the patched Megatron code calls when ``STATE.active`` is true.

The patched autograd Functions of ``tensor_parallel/layers.py`` call ``linear_forward``,
``linear_dgrad``, ``linear_wgrad`` (or, under gradient_accumulation_fusion,
``linear_wgrad_fused``) and ``linear_backward_post``; the patched
``DotProductAttention.forward`` calls ``attention_forward`` and, for P·V, ``attention_probs``.
Each computes exactly what the unpatched code computes (same ops, same order) unless a
format is being emulated, and captures through the process-wide saver.

Where each call sits in the model (module path, 0-based layer index) comes from
:mod:`tensor_capture.sites`; each tensor goes to the saver as a ``schema.CaptureSite`` (that
place plus layer type, operation, phase, tensor name, component, variant) with the iteration
and micro-batch of its call.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from quant import gemm_plan
from quant.gemm_plan import OperandPlan

from . import emulation, schema
from .saver import get_tensor_saver
from .schema import CaptureSite
from .sites import UNKNOWN_SITE, Site
from .state import STATE


# -- linear ------------------------------------------------------------------------------------------
@dataclass
class _LinearCall:
    """What the backward of one linear call needs from its forward; it rides on the autograd
    ctx because other forwards (micro-batches, pipeline stages) run before this backward."""
    site: Site
    iteration: int
    sample_idx: int | None
    capture_bwd: bool


#: layer type -> the component its captures are named with
_COMPONENT = {"linear": "linear", "attention": "FA"}


@functools.lru_cache(maxsize=1 << 14)
def _at(where: Site, layer_type: str, operation: str, phase: str, tensor_name: str,
        variant: str = schema.VARIANT_HP) -> CaptureSite:
    """The capture site of ``tensor_name`` in the module at ``where``. Cached: the same few
    hundred sites recur every step, and a lookup costs a tenth of building a frozen record
    (every candidate tensor pays it, captured or filtered out)."""
    return CaptureSite(layer_type=layer_type, operation=operation, phase=phase,
                       tensor_name=tensor_name, component=_COMPONENT[layer_type],
                       layer_idx=where.layer_idx, module_path=where.module_path,
                       submodule=where.submodule, variant=variant)


def _save(saver, t: torch.Tensor, site: CaptureSite, it: int, sample: int | None,
          axis: int | None = None, whatif_axis: int | None = None,
          metadata: dict[str, Any] | None = None) -> None:
    """Capture ``t``, which the caller just found selected (saver.captures)."""
    saver.take(t, site, it, sample, quant_axis=axis, whatif_axis=whatif_axis, metadata=metadata)


# -- emulation: each GEMM operand quantized along quant.gemm_plan's axis ----------------------------
#: layer type -> the underflow warning's operand kind (tensor_capture.underflow)
_KIND = {"linear": "linear {gemm} {operand}", "attention": "attention {operand}"}
_FORWARD_GEMMS = frozenset({"fprop", "qk", "pv"})


def _quantized_name(p: OperandPlan) -> str:
    """The captured name of a quantized operand (the wgrad GEMM's carry a suffix)."""
    return schema.quantized_name(p.operand, wgrad=p.gemm == "wgrad")


def _emulator(saver, cap: bool, layer_type: str, site: Site, it: int, sample: int | None,
              ste: bool = False) -> gemm_plan.QuantizeOperand:
    """The quantizer of the emulated CUSTOM_QUANT_TYPE for one call (linear operands: the
    recipe's spec of the operand role; attention: its format) along the plan's axis,
    with the underflow warning, capturing each quantized operand when save_quantized."""
    keep = cap and saver.config.save_quantized
    kind = _KIND[layer_type]

    def q(t: torch.Tensor, p: OperandPlan) -> torch.Tensor:
        what = kind.format(gemm=p.gemm, operand=p.operand)
        if layer_type == "linear":      # the recipe's quantizer of this operand role
            out = emulation.quantize_operand(t, p.operand, p.gemm, kind=what,
                                             site=site.module_path, iteration=it,
                                             layer=site.layer_idx)
        else:
            fn = emulation.quantize_ste if ste else emulation.quantize
            out = fn(t, axis=p.axis, kind=what, site=site.module_path, iteration=it,
                     layer=site.layer_idx, operand=(p.gemm, p.operand))
        if keep:
            op = "forward" if p.gemm in _FORWARD_GEMMS else "backward"
            at = _at(site, layer_type, op, "pre", _quantized_name(p), schema.VARIANT_QUANTIZED)
            if saver.captures(at, it):
                _save(saver, out, at, it, sample)
        return out

    return q


#: the pass each linear GEMM's operands are captured in (capture's "operation")
_GEMM_OPERATION = {"fprop": "forward", "dgrad": "backward"}


def _save_operands(saver, site: Site, gemm: str, tensors: tuple, it: int,
                   sample: int | None) -> None:
    """Capture a linear GEMM's operands (phase pre), each with its reduction axis."""
    for p, t in zip(gemm_plan.GEMM_OPERANDS[gemm], tensors):
        at = _at(site, "linear", _GEMM_OPERATION[gemm], "pre", p.operand)
        if saver.captures(at, it):
            _save(saver, t, at, it, sample, axis=p.axis)


def linear_forward(ctx: Any, total_input: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """input @ weight.t() (+ bias), on fake-quantized operands when emulating; captures."""
    saver = get_tensor_saver()
    site = STATE.current_linear or UNKNOWN_SITE
    it, sample = saver.iteration, saver.sample_idx
    cap = saver.enabled and not STATE.paused
    ctx._tc = _LinearCall(site, it, sample, cap)
    if cap:
        _save_operands(saver, site, "fprop", (total_input, weight), it, sample)
    q = _emulator(saver, cap, "linear", site, it, sample) if STATE.emulate else None
    output = gemm_plan.linear_forward(total_input, weight, bias, q)
    if cap:
        at = _at(site, "linear", "forward", "post", "output")
        if saver.captures(at, it):
            _save(saver, output, at, it, sample)
    return output


def _call(ctx: Any) -> _LinearCall:
    call = getattr(ctx, "_tc", None)
    if call is None:
        saver = get_tensor_saver()
        call = _LinearCall(UNKNOWN_SITE, saver.iteration, saver.sample_idx,
                           saver.enabled and not STATE.paused)
    return call


def linear_dgrad(ctx: Any, grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad_output @ weight, operands quantized along the dgrad plan (out-features) when emulating."""
    call = _call(ctx)
    saver = get_tensor_saver()
    cap = call.capture_bwd and saver.enabled
    site, it, sample = call.site, call.iteration, call.sample_idx
    if cap:
        _save_operands(saver, site, "dgrad", (grad_output, weight), it, sample)
    q = _emulator(saver, cap, "linear", site, it, sample) if STATE.emulate else None
    return gemm_plan.linear_dgrad(grad_output, weight, q)


def _wgrad_operands(ctx: Any, grad_output: torch.Tensor,
                    total_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The wgrad GEMM's operands: quantized along the wgrad plan (tokens) when emulating."""
    g, a = gemm_plan.quantize_operands("wgrad", (grad_output, total_input), _wgrad_emulator(ctx))
    return g, a


def _wgrad_emulator(ctx: Any) -> gemm_plan.QuantizeOperand | None:
    if not STATE.emulate:
        return None
    call = _call(ctx)
    saver = get_tensor_saver()
    return _emulator(saver, call.capture_bwd and saver.enabled, "linear", call.site,
                     call.iteration, call.sample_idx)


def linear_wgrad(ctx: Any, grad_output: torch.Tensor, total_input: torch.Tensor) -> torch.Tensor:
    """grad_output.t() @ input (2-D), operands quantized along the wgrad plan (tokens) when emulating."""
    return gemm_plan.linear_wgrad(grad_output, total_input, _wgrad_emulator(ctx))


# apex's fused_weight_gradient_mlp_cuda: main_grad dtype -> the function upstream calls.
APEX_MODULE = "fused_weight_gradient_mlp_cuda"
_APEX_ACCUM = {torch.float32: "wgrad_gemm_accum_fp32", torch.float16: "wgrad_gemm_accum_fp16",
               torch.bfloat16: "wgrad_gemm_accum_fp16"}


def _micro_batch_wgrad(g: torch.Tensor, a: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """g.t() @ a as the fused kernel forms it: in float32 for a float32 main_grad, else in the
    main_grad's dtype."""
    acc = main_grad.dtype
    return torch.matmul(g.t().to(acc), a.to(acc))


def linear_wgrad_fused(ctx: Any, grad_output: torch.Tensor, total_input: torch.Tensor,
                       main_grad: torch.Tensor) -> None:
    """gradient_accumulation_fusion: add this micro-batch's weight gradient to ``main_grad``.

    The operands are the ones :func:`linear_wgrad` uses (quantized the same way when
    emulating); the accumulation is apex's kernel when megatron loaded it (so capture without
    emulation keeps upstream's numerics), else the same sum in torch. The micro-batch gradient
    itself (not the dummy Megatron returns) is captured as ``grad_weight``.
    """
    name = _APEX_ACCUM.get(main_grad.dtype)
    if name is None:
        raise RuntimeError(f"Unsupported gradient type for gradient accumulation fusion: "
                           f"main_grad is {main_grad.dtype}")
    g, a = _wgrad_operands(ctx, grad_output, total_input)
    apex = sys.modules.get(APEX_MODULE)
    if apex is not None:
        getattr(apex, name)(a, g, main_grad)
    else:
        main_grad.add_(_micro_batch_wgrad(g, a, main_grad))
    call = _call(ctx)
    if call.capture_bwd:
        saver = get_tensor_saver()
        at = _at(call.site, "linear", "backward", "post", "grad_weight")
        if saver.enabled and saver.captures(at, call.iteration):
            _save(saver, _micro_batch_wgrad(g, a, main_grad), at, call.iteration,
                  call.sample_idx)


def linear_backward_post(ctx: Any, grad_input: torch.Tensor | None,
                         grad_weight: torch.Tensor | None) -> None:
    """Capture grad_input (after the tensor-parallel all-reduce) and grad_weight.

    Under gradient_accumulation_fusion ``grad_weight`` is a dummy (the gradient went into
    main_grad and was captured by :func:`linear_wgrad_fused`), so it is not captured here.
    """
    call = _call(ctx)
    saver = get_tensor_saver()
    if not (call.capture_bwd and saver.enabled):
        return
    if getattr(ctx, "gradient_accumulation_fusion", False):
        grad_weight = None
    for name, t in (("grad_input", grad_input), ("grad_weight", grad_weight)):
        if t is None:
            continue
        at = _at(call.site, "linear", "backward", "post", name)
        if saver.captures(at, call.iteration):
            _save(saver, t, at, call.iteration, call.sample_idx)


# -- attention ---------------------------------------------------------------------------------------
_QKV = (gemm_plan.plan("qk", "query"), gemm_plan.plan("qk", "key"), gemm_plan.plan("pv", "value"))
_PROBS = gemm_plan.plan("pv", "probs")


def _attention_site(module: torch.nn.Module) -> Site:
    site = STATE.sites.get(module)
    number = getattr(module, "layer_number", None)
    idx = number - 1 if isinstance(number, int) else None
    if site is None:
        return Site(None, "core_attention", idx)
    if isinstance(number, int) and site.layer_idx != idx:
        return Site(site.module_path, site.submodule, idx)
    return site


def _grad_hook(saver, at: CaptureSite, it: int, sample: int | None):
    def hook(grad: torch.Tensor) -> None:
        if saver.enabled:    # asked again: the saver may have changed its mind since (budget)
            saver.capture(grad, at, iteration=it, sample_idx=sample)
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
    cap = saver.enabled and not STATE.paused
    inspector = STATE.inspector    # the debug API's route (te_integration), hp tensors
    site = (_attention_site(module) if cap or STATE.warn_underflow or inspector is not None
            or STATE.plan is not None else UNKNOWN_SITE)
    it, sample = saver.iteration, saver.sample_idx
    if inspector is not None:
        inspector(module, site, it, {"query": query, "key": key, "value": value})
    if cap:
        for p, t in zip(_QKV, (query, key, value)):
            at = _at(site, "attention", "forward", "pre", p.operand)
            if saver.captures(at, it):
                _save(saver, t, at, it, sample,
                      axis=p.axis if emulate and STATE.emulate_attention else None,
                      whatif_axis=p.axis)   # its Q·Kᵀ / P·V reduction axis, emulated or not
            grad_at = _at(site, "attention", "backward", "post", "grad_" + p.operand)
            if t.requires_grad and saver.captures(grad_at, it):
                t.register_hook(_grad_hook(saver, grad_at, it, sample))
    if emulate and STATE.emulate_attention:
        # Q·Kᵀ and P·V operands along quant.gemm_plan's axes (P: quantize_probs, in the
        # forward); straight-through gradients.
        q = _emulator(saver, cap, "attention", site, it, sample, ste=True)
        query, key, value = (q(t, p) for p, t in zip(_QKV, (query, key, value)))
    STATE.running_attention = site
    context = forward(query, key, value, *args, **kwargs)
    if inspector is not None:
        inspector(module, site, it, {"context": context})
    if cap:
        at = _at(site, "attention", "forward", "post", "context")
        if saver.captures(at, it):
            _save(saver, context, at, it, sample)
        grad_at = _at(site, "attention", "backward", "pre", "grad_context")
        if context.requires_grad and saver.captures(grad_at, it):
            context.register_hook(_grad_hook(saver, grad_at, it, sample))
    return context


def quantize_probs(attention_probs: torch.Tensor) -> torch.Tensor:
    """P of P·V, fake-quantized along the plan's axis (the key axis), gradient passed through.
    (What trees patched before probability capture call; :func:`attention_probs` now.)"""
    running = STATE.running_attention or UNKNOWN_SITE
    return emulation.quantize_ste(attention_probs, axis=_PROBS.axis, kind="attention probs",
                                  site=running.module_path, layer=running.layer_idx,
                                  iteration=get_tensor_saver().iteration,
                                  operand=(_PROBS.gemm, _PROBS.operand))


def probs_sample(probs: torch.Tensor, head_count: int | None, heads: int, rows: int
                 ) -> tuple[torch.Tensor, dict[str, Any]]:
    """``heads`` evenly spaced heads of the micro-batch's first sequence and at most ``rows``
    evenly strided query rows of ``probs`` ([batch*heads, queries, keys]), every key kept (the
    P·V reduction axis, so what-if blocks stay whole): a small copy and its description
    (schema.META_PROBS_SAMPLE)."""
    n = probs.shape[0]
    hc = head_count if isinstance(head_count, int) and 0 < head_count <= n else n
    keep = min(heads, hc)
    idx = sorted({(i * hc) // keep for i in range(keep)})
    stride = max(1, -(-probs.shape[1] // rows))
    step = idx[1] - idx[0] if len(idx) > 1 else 1
    if idx == list(range(idx[0], idx[-1] + 1, step)):    # evenly spaced: a view, no copy
        part = probs.detach()[idx[0]:idx[-1] + 1:step, ::stride]
    else:
        part = probs.detach()[idx, ::stride]
    return part, {"heads": idx, "head_count": hc, "row_stride": stride,
                  "shape": list(probs.shape)}


def attention_probs(module: torch.nn.Module, probs: torch.Tensor) -> torch.Tensor:
    """P of P·V (softmax output after dropout): captures a sample of heads and query rows
    (config probs_heads / probs_rows) with what-if numerics along the key axis; when
    attention is emulated returns P fake-quantized along that axis (gradient passed through)."""
    saver = get_tensor_saver()
    cfg = saver.config
    out = quantize_probs(probs) if STATE.emulate_attention else probs
    if STATE.inspector is not None:          # the debug API's route (te_integration): all of P
        STATE.inspector(module, _attention_site(module), saver.iteration, {"probs": probs})
    if not (saver.enabled and not STATE.paused and cfg.probs_heads > 0 and probs.dim() == 3):
        return out
    site = _attention_site(module)
    it, sample = saver.iteration, saver.sample_idx
    heads = getattr(module, "num_attention_heads_per_partition", None)
    todo = [(probs, schema.ATTENTION_PROBS, schema.VARIANT_HP)]
    if out is not probs and cfg.save_quantized:
        todo.append((out, schema.quantized_name(schema.ATTENTION_PROBS), schema.VARIANT_QUANTIZED))
    for t, name, variant in todo:
        at = _at(site, "attention", "forward", "pre", name, variant)
        if saver.captures(at, it):
            part, info = probs_sample(t, heads, cfg.probs_heads, cfg.probs_rows)
            _save(saver, part, at, it, sample, whatif_axis=_PROBS.axis,
                  metadata={schema.META_PROBS_SAMPLE: info})
    return out
