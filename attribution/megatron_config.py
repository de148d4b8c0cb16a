"""A precision plan as Megatron-LM's per-module precision config (``--te-precision-config-file``).

Megatron-LM's format (read in NVIDIA/Megatron-LM ``megatron/core/quantization/quant_config.py``
and ``megatron/core/extensions/transformer_engine.py``, 2026): a YAML mapping with ``configs``
(name -> ``{transformer_engine_config_type: TEQuantizationParams, training_recipe: {...}}``,
where an empty ``training_recipe`` means high precision and ``fp8_quantization_recipe`` is one of
tensorwise / blockwise / mxfp8 (delayed is refused there), ``fp4_quantization_recipe`` nvfp4,
``fp8_format`` e4m3 (its default) or hybrid) and ``matchers`` (ordered; ``type: glob``,
``enabled: true``, ``pattern`` an fnmatch pattern on the module path such as
``decoder.layers.0.mlp.linear_fc1``, ``config``); the first enabled match wins, an unmatched
module keeps the run's global recipe. It selects one recipe per *module*: all three GEMMs of a
module share it, so a plan that splits a module's GEMMs, or selects GEMM operands (a rule with
``operands``), cannot be converted (one line says so and names the custom-recipe route, where
our quantizer factory reads the plan per GEMM and operand).
Only Transformer Engine recipes (te_*) and high precision have a Megatron-LM spelling.
"""
from __future__ import annotations

from typing import Iterable

from lowp_common import UserError
from quant.precision_plan import PlanSite, PrecisionPlan
from quant.vocabulary import HIGH_PRECISION, LINEAR_GEMMS, LINEAR_OPERANDS

#: our recipe -> Megatron-LM training_recipe ({}: high precision)
TRAINING_RECIPE: dict[str, dict] = {
    HIGH_PRECISION: {}, "bf16": {}, "fp32": {},
    "te_fp8_tensorwise": {"fp8_quantization_recipe": "tensorwise", "fp8_format": "hybrid"},
    "te_fp8_blockwise": {"fp8_quantization_recipe": "blockwise", "fp8_format": "e4m3"},
    "te_mxfp8": {"fp8_quantization_recipe": "mxfp8", "fp8_format": "e4m3"},
    "te_nvfp4": {"fp4_quantization_recipe": "nvfp4"},
}
CUSTOM_ROUTE = ("--fp8-recipe custom --fp8-quantizer-factory te_integration.factory."
                "quantizer_factory with CUSTOM_QUANT_PLAN")


def to_megatron(plan: PrecisionPlan, sites: Iterable[PlanSite], default: str) -> dict:
    """Megatron-LM's precision config for the modules of ``sites`` whose GEMMs the plan puts in
    another format than ``default`` (the run's global recipe); UserError when it cannot."""
    configs: dict[str, dict] = {}
    matchers: dict[str, dict] = {}
    for site in sites:
        if site.roles != LINEAR_GEMMS:
            continue        # core attention: Megatron's config addresses linear modules only
        by_operand = [r for r in site.roles
                      if getattr(plan.rule_for(site.path, site.layer, r), "operands",
                                 LINEAR_OPERANDS) != LINEAR_OPERANDS]
        if by_operand:
            raise UserError(f"{site.path}: the plan selects operands of its "
                            f"{', '.join(by_operand)} GEMM(s) (a rule with operands); "
                            "Megatron-LM's --te-precision-config-file sets one recipe per "
                            f"module: run this plan through {CUSTOM_ROUTE}")
        fmts = {r: plan.format_for(site.path, site.layer, r, default=default) for r in site.roles}
        if len(set(fmts.values())) > 1:
            raise UserError(f"{site.path}: the plan gives its GEMMs different formats "
                            f"({', '.join(f'{r} {f}' for r, f in fmts.items())}); Megatron-LM's "
                            "--te-precision-config-file sets one recipe per module: run this "
                            f"plan through {CUSTOM_ROUTE}")
        fmt = next(iter(fmts.values()))
        if fmt == default:
            continue
        if fmt not in TRAINING_RECIPE:
            raise UserError(f"{site.path}: {fmt} has no Megatron-LM recipe (its per-module "
                            f"config takes {', '.join(sorted(TRAINING_RECIPE))}); run this plan "
                            f"through {CUSTOM_ROUTE}")
        name = "high_precision" if not TRAINING_RECIPE[fmt] else fmt
        configs[name] = {"transformer_engine_config_type": "TEQuantizationParams",
                         "training_recipe": dict(TRAINING_RECIPE[fmt])}
        matchers[f"m{len(matchers):03d}_{name}"] = {"type": "glob", "enabled": True,
                                                   "pattern": site.path, "config": name}
    return {"configs": configs, "matchers": matchers}
