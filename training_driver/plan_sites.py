"""The GEMM sites of a megatron-core model that a precision plan (CUSTOM_QUANT_PLAN) addresses.

A plan whose rule matches no GEMM of the model is a mistake (a typo in a regex, a layer the
model does not have) that would otherwise change nothing silently: ``check_plan_covers``
refuses it in one line before training starts.
"""
from __future__ import annotations

from typing import Optional

from .errors import UserError

_ATTENTION_CLASSES = ("DotProductAttention", "TEDotProductAttention")


def _is_linear(name: str) -> bool:
    return name in ("ColumnParallelLinear", "RowParallelLinear") or (
        name.startswith("TE") and "Linear" in name)


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
