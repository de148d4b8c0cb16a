"""The GEMM sites of a megatron-core model that a precision plan (CUSTOM_QUANT_PLAN) addresses.

A plan whose rule matches no GEMM of the model is a mistake (a typo in a regex, a layer the
model does not have) that would otherwise change nothing silently: ``check_plan_covers``
refuses it in one line before training starts.
"""
from __future__ import annotations

from typing import Optional

from lowp_common.cli import UserError

_ATTENTION_CLASSES = ("DotProductAttention", "TEDotProductAttention")


def _is_linear(name: str) -> bool:
    from tensor_capture.sites import LINEAR_CLASSES

    return name in LINEAR_CLASSES or (name.startswith("TE") and "Linear" in name)


def model_sites(model) -> list:
    """Every GEMM site of ``model`` as quant.precision_plan.PlanSite (path, 0-based layer,
    roles: a linear's fprop / dgrad / wgrad, attention's fprop)."""
    from quant.precision_plan import ROLES, PlanSite
    from tensor_capture.sites import register_model, site_of

    register_model(model)
    out = []
    for _, m in model.named_modules():
        name = type(m).__name__
        if _is_linear(name) or name in _ATTENTION_CLASSES:
            site = site_of(m)
            out.append(PlanSite(site.module_path or "", site.layer_idx,
                                ROLES if _is_linear(name) else ("fprop",)))
    return out


def check_plan_covers(model, plan_path: Optional[str]) -> None:
    """UserError (one line) when a rule of the plan at ``plan_path`` matches no GEMM of
    ``model``; nothing when ``plan_path`` is empty."""
    if not plan_path:
        return
    from quant.precision_plan import PlanError, load_plan

    try:
        load_plan(plan_path).check_matches(model_sites(model))
    except PlanError as exc:
        raise UserError(str(exc)) from None


def check_plan_covers_shape(shape: dict[str, int], plan_path: str) -> None:
    """``check_plan_covers`` before any training process exists (the launcher's Megatron-LM
    path): the GEMM sites depend on the layer count and layer spec, not on the widths, so a
    narrow model of the same depth (one process, gloo) stands for the real one."""
    from .megatron_env import LlamaShape, build_llama_model, destroy_distributed, init_distributed

    groups = shape["num_query_groups"]
    heads = shape["num_attention_heads"]
    narrow = LlamaShape(num_layers=shape["num_layers"], hidden_size=4 * heads,
                        ffn_hidden_size=8, num_attention_heads=heads, num_query_groups=groups,
                        vocab_size=128, seq_length=8)
    init_distributed()
    try:
        check_plan_covers(build_llama_model(narrow), plan_path)
    finally:
        destroy_distributed()
