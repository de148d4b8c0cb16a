"""The quantizer factory of Transformer Engine's custom recipe: our formats inside TE layers.

Megatron-LM (megatron-core >= 0.16)::

    CUSTOM_QUANT_TYPE=mxfp8 ... --fp8-recipe custom \\
        --fp8-quantizer-factory te_integration.factory.quantizer_factory

or plain TE: ``CustomRecipe(qfactory=te_integration.factory.quantizer_factory)``. TE calls the
factory once per quantizer slot with a ``QuantizerRole`` (module_type linear / grouped_linear /
dpa, tensor_type input / weight / grad_output / ..., name). Linear GEMM operands get our
custom quantizer in the chosen format (te_integration.te_quantizer: values
from quant.quantize along each GEMM's reduction axis, the GEMM in high precision); every other
slot stays in high precision (our quantizer with "hp"), including DotProductAttention's (TE's
fused attention takes only TE's own quantizer families, so it cannot run our emulation: our
attention emulation is on the megatron-core side, tensor_capture). A grouped linear (MoE
``--moe-grouped-gemm``) is refused in one line: TE's grouped GEMM cannot run a custom quantizer.

Which format: one precision plan (quant.precision_plan, :func:`role_plan`) asked per layout of
each linear operand slot, first match wins: the LOWP_TE_ROLE_FORMATS rules, then the rules and
default of the plan CUSTOM_QUANT_PLAN names, then CUSTOM_QUANT_TYPE (any quant.FORMATS name).
LOWP_TE_ROLE_FORMATS is a compact spelling of plan rules (:func:`parse_rules`):
``field=value[,field=value]:format`` separated by ``;`` with fields of QuantizerRole:
``tensor_type`` the operands (input / weight / grad_output), ``name=suffix`` a dotted suffix of
the module path (``name=linear_fc2`` and ``name=layers.1.mlp.linear_fc2`` both match
``decoder.layers.1.mlp.linear_fc2``), ``field~=regex`` a search, ``module_type`` only ``linear``
(our formats apply to linear operand slots alone); format a quant.FORMATS name or ``hp``, e.g.
``tensor_type=grad_output:fp8_e5m2_tensor;name=linear_fc2,tensor_type=weight:nvfp4``.

The role's ``name`` is the module path, its layer the number after ``layers.`` in it, and each
layout of the slot gets the format of the GEMM it feeds (``layouts.LAYOUT_GEMM``: an input's
rowwise layout feeds fprop, its columnwise one wgrad, ...); a rule without GEMM roles gives
both layouts its format. TE names a module only when something assigned the name
(:func:`module_path`: a name the debug API's infer_and_assign_layer_names gave, which numbers
layers from 1, is mapped back to the module path, for plan and LOWP_TE_ROLE_FORMATS rules
alike); an unnamed role matches only rules without ``modules`` / ``layers`` (a name rule of
LOWP_TE_ROLE_FORMATS on an unnamed layer is refused: :func:`check_role`).

Transformer Engine is imported on the first call only; a TE older than the custom-recipe
quantizer roles is one line naming the version needed.
"""
from __future__ import annotations

import os
import re
import sys
from functools import lru_cache
from typing import Any, Callable, Mapping, Optional

from lowp_common import CommandParser, UserError
from quant.vocabulary import (
    ENV_PLAN,
    ENV_QUANT,
    HIGH_PRECISION,
    LINEAR_OPERANDS,
    FormatNameError,
    check_format_name,
)

from .layouts import LAYOUT_GEMM

ENV_ROLE_FORMATS = "LOWP_TE_ROLE_FORMATS"
#: the dotted path Megatron-LM's --fp8-quantizer-factory takes
FACTORY_PATH = "te_integration.factory.quantizer_factory"
#: TE that has CustomRecipe (2.9) and QuantizerRole's module_type / tensor_type / name (2.16)
MIN_TE_VERSION = (2, 16)
ROLE_FIELDS = ("module_type", "tensor_type", "name")
#: the roles our format applies to by default: the three operands of linear GEMMs
LINEAR_MODULES = ("linear",)
#: module types our emulation cannot run inside, and the one line that says so
UNSUPPORTED_MODULES = {
    "grouped_linear": (f"{FACTORY_PATH} cannot emulate Transformer Engine's GroupedLinear (its "
                       "grouped GEMM takes only TE's own quantized tensors): run the MoE experts "
                       "without --moe-grouped-gemm, or without the custom recipe"),
}


class FactoryError(UserError, ValueError):
    """A factory setting (environment variable) is wrong; the message names it and the fix."""


def _field_matches(actual: str, op: str, value: str) -> bool:
    return re.search(value, actual) is not None if op == "~=" else actual == value


def _check_format(name: str, where: str) -> str:
    """A format name or "hp" (quant.vocabulary's one check); FactoryError otherwise."""
    try:
        return check_format_name(name, where)
    except FormatNameError as exc:
        raise FactoryError(str(exc)) from None


def parse_rules(text: str, where: str = ENV_ROLE_FORMATS) -> tuple[Any, ...]:
    """``field=value[,field=value]:format;...`` -> quant.precision_plan.PlanRule s (FactoryError
    names the bad part): the compact spelling of plan rules, see :func:`_plan_rule`."""
    rules = []
    for part in filter(None, (p.strip() for p in (text or "").split(";"))):
        lhs, sep, fmt = part.rpartition(":")
        if not sep or not lhs.strip():
            raise FactoryError(f"{where}: rule {part!r} needs 'field=value:format' "
                               f"(fields: {', '.join(ROLE_FIELDS)})")
        match = []
        for cond in lhs.split(","):
            field, op, value = _split_condition(cond)
            if op is None or field not in ROLE_FIELDS or not value:
                raise FactoryError(f"{where}: {cond.strip()!r} in rule {part!r} is not "
                                   f"'field=value' or 'field~=regex' with a field of "
                                   f"{', '.join(ROLE_FIELDS)}")
            if op == "~=":
                try:
                    re.compile(value)
                except re.error as exc:
                    raise FactoryError(f"{where}: {value!r} in rule {part!r} is not a regular "
                                       f"expression ({exc})") from None
            match.append((field, op, value))
        rules.append(_plan_rule(match, _check_format(fmt, f"{where} rule {part!r}"),
                                f"{where}: rule {part!r}"))
    return tuple(rules)


def _plan_rule(match: list[tuple[str, str, str]], fmt: str, where: str) -> Any:
    """One rule's conditions as a plan rule: ``name=suffix`` a module regex matching the dotted
    suffix (``(^|\\.)suffix$``), ``name~=regex`` the regex (several: all must match);
    ``tensor_type`` the operands it matches; ``module_type`` must match ``linear``: our formats
    apply to linear GEMM operands only (every other slot stays in high precision)."""
    from quant.precision_plan import PlanRule

    modules, operands = [], list(LINEAR_OPERANDS)
    for field, op, value in match:
        if field == "name":
            modules.append(value if op == "~=" else rf"(^|\.){re.escape(value)}$")
        elif field == "tensor_type":
            operands = [o for o in operands if _field_matches(o, op, value)]
        elif not any(_field_matches(m, op, value) for m in LINEAR_MODULES):
            raise FactoryError(f"{where}: module_type {value!r} selects no slot our formats "
                               f"apply to: they apply to the operands of linear GEMMs "
                               f"(module_type=linear), every other slot stays in high precision; "
                               "drop the condition")
    if not operands:
        raise FactoryError(f"{where}: tensor_type selects no operand of a linear GEMM "
                           f"({', '.join(LINEAR_OPERANDS)}), the only slots our formats apply "
                           "to; fix or drop the condition")
    pattern = (modules[0] if len(modules) == 1
               else "^" + "".join(f"(?=.*?(?:{m}))" for m in modules) if modules else None)
    return PlanRule(fmt, modules=pattern, operands=tuple(operands))


def _split_condition(cond: str) -> tuple[str, Optional[str], str]:
    """``field=value`` / ``field~=regex`` -> (field, operator, value); operator None if neither."""
    for op in ("~=", "="):
        field, sep, value = cond.partition(op)
        if sep:
            return field.strip(), op, value.strip()
    return cond.strip(), None, ""


def role_plan(rules: tuple[Any, ...] = (), plan: Any = None) -> Any:
    """The one plan the factory asks: LOWP_TE_ROLE_FORMATS rules first, then CUSTOM_QUANT_PLAN's
    rules and default (first match wins); what none decides gets CUSTOM_QUANT_TYPE."""
    from quant.precision_plan import PrecisionPlan

    if plan is None:
        return PrecisionPlan(tuple(rules), None, ENV_ROLE_FORMATS)
    return PrecisionPlan(tuple(rules) + plan.rules, plan.default, plan.source)


def slot_formats(role: Any, plan: Any, default: str) -> tuple[str, str]:
    """(rowwise, columnwise) formats of one quantizer slot: an operand of a linear GEMM gets,
    per layout, the plan's format for that operand in the GEMM the layout feeds; every other
    slot (None role included) "hp"."""
    tensor = getattr(role, "tensor_type", "") if role is not None else ""
    if getattr(role, "module_type", "") not in LINEAR_MODULES or tensor not in LINEAR_OPERANDS:
        return HIGH_PRECISION, HIGH_PRECISION
    path, layer = module_path(str(getattr(role, "name", "") or ""))
    row, col = (_check_format(plan.format_for(path, layer, LAYOUT_GEMM[(tensor, lay)],
                                              default=default, operand=tensor),
                              f"{ENV_PLAN} ({plan.source})") for lay in ("rowwise", "columnwise"))
    return row, col


def module_path(name: str) -> tuple[Optional[str], Optional[int]]:
    """A TE layer name as the module path our plans match and its 0-based layer: a name
    infer_and_assign_layer_names gave ("model.decoder.layers.4..." with megatron's 1-based
    layer_number) loses "model." and counts from 0 ("decoder.layers.3...")."""
    from .names import layer_index

    if not name:
        return None, None
    layer = layer_index(name)
    if name.startswith("model."):
        name = name[len("model."):]
        if layer is not None:
            name = re.sub(r"(^|\.)layers\.\d+(\.|$)", rf"\g<1>layers.{layer}\g<2>", name,
                          count=1)
    return name, layer


def load_plan_env(env: Optional[Mapping[str, str]] = None) -> Any:
    """The precision plan CUSTOM_QUANT_PLAN names (None when unset); FactoryError on a bad one."""
    from quant.precision_plan import PlanError, load_plan

    env = os.environ if env is None else env
    path = env.get(ENV_PLAN, "").strip()
    if not path:
        return None
    try:
        return load_plan(path)
    except PlanError as exc:
        raise FactoryError(str(exc)) from None


def default_format(env: Optional[Mapping[str, str]] = None) -> str:
    """CUSTOM_QUANT_TYPE (or the plan's default), checked as capture checks it (FactoryError
    when unset or unknown)."""
    from tensor_capture.config import ConfigError, load_config

    env = os.environ if env is None else env
    value = env.get(ENV_QUANT, "")
    try:
        name = load_config(env={ENV_QUANT: value, ENV_PLAN: env.get(ENV_PLAN, "")}).quant_type
    except ConfigError as exc:
        raise FactoryError(str(exc)) from None
    if name is None:
        raise FactoryError(f"{ENV_QUANT} is not set: the TE quantizer factory needs the format "
                           "to emulate (e.g. CUSTOM_QUANT_TYPE=mxfp8)")
    return _check_format(name, ENV_QUANT)


def te_version_tuple(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_te_version(text: str) -> None:
    """FactoryError (one line) unless ``text`` is a TE version with the custom-recipe roles."""
    if te_version_tuple(text) < MIN_TE_VERSION:
        need = ".".join(map(str, MIN_TE_VERSION))
        raise FactoryError(
            f"Transformer Engine {text or '(unknown version)'} is too old for "
            f"{FACTORY_PATH}: it needs transformer-engine >= {need} (CustomRecipe with "
            f"QuantizerRole); pip install -U 'transformer-engine[pytorch]>={need}'")


def installed_te_version() -> str:
    """The installed TE's version (FactoryError when it does not import)."""
    try:
        import transformer_engine
    except Exception as exc:
        need = ".".join(map(str, MIN_TE_VERSION))
        raise FactoryError(f"{FACTORY_PATH} needs Transformer Engine >= {need}, which does not "
                           f"import here ({type(exc).__name__}: "
                           f"{(str(exc).splitlines() or [''])[0][:160]})") from None
    return str(getattr(transformer_engine, "__version__", ""))


def make_factory(default: str, rules: tuple[Any, ...] = (),
                 plan: Any = None) -> Callable[[Any], Any]:
    """A qfactory returning our emulating quantizer for each role (TE imported on first call),
    its formats from :func:`role_plan` (``rules`` from :func:`parse_rules`, then ``plan``)."""
    default = _check_format(default, "default format")
    one = role_plan(rules, plan)

    def qfactory(role: Any) -> Any:
        te_quantizer = _te_quantizer_module()
        check_debug_api_off()
        check_role(role, rules)
        row, col = slot_formats(role, one, default)
        return te_quantizer.EmulatedQuantizer(row, getattr(role, "tensor_type", "") or "",
                                              fmt_columnwise=col)

    return qfactory


DEBUG_API_CONFLICT = (
    f"{FACTORY_PATH} cannot run while TE's debug API (nvdlfw-inspect) is initialized: TE's "
    "debug path hands the custom recipe's tensors to its cuBLAS GEMM, which refuses them; run "
    "our debug features with bf16 or a native FP8 recipe, and the custom recipe without them")


def check_debug_api_off() -> None:
    """FactoryError (one line) while nvdlfw-inspect's debug API is initialized (TE 2.16-2.20
    send debug-wrapped tensors to the native GEMM, never to our qgemm)."""
    api = sys.modules.get("nvdlfw_inspect.api")
    if api is not None and getattr(api, "DEBUG_MANAGER", None) is not None:
        raise FactoryError(DEBUG_API_CONFLICT)


#: the name TE gives a module nobody named (``Layer_<count>``)
_TE_PLACEHOLDER_NAME = re.compile(r"Layer_\d+")


def _unnamed(name: str) -> bool:
    return not name or _TE_PLACEHOLDER_NAME.fullmatch(name) is not None


def check_role(role: Any, rules: tuple[Any, ...] = ()) -> None:
    """FactoryError (one line) for a slot our emulation would get wrong: a grouped linear
    (TE's grouped GEMM takes only its own quantized tensors), or a layer without a name while
    a rule selects layers by name (it would silently never match)."""
    if role is None:
        return
    module_type = str(getattr(role, "module_type", "") or "")
    if module_type in UNSUPPORTED_MODULES:
        raise FactoryError(UNSUPPORTED_MODULES[module_type])
    if _unnamed(str(getattr(role, "name", "") or "")) and module_type in LINEAR_MODULES and any(
            r.modules is not None for r in rules):
        raise FactoryError(
            f"{ENV_ROLE_FORMATS} selects layers by name, but Transformer Engine gave this "
            f"{module_type} none (Megatron-LM passes none, TE then says Layer_N, unless the layers "
            "are named): run pretrain_gpt.py through python -m te_integration.megatron_lm, which "
            "names them by module path, or drop the name rules")


@lru_cache(maxsize=1)
def _te_quantizer_module():
    check_te_version(installed_te_version())
    from . import te_patches, te_quantizer

    lacking = te_patches.missing()
    if lacking:
        raise FactoryError(f"Transformer Engine {installed_te_version()} lacks what "
                           f"{FACTORY_PATH} needs for {'; '.join(lacking)}")
    te_patches.install()
    return te_quantizer


@lru_cache(maxsize=1)
def _from_env() -> Callable[[Any], Any]:
    return make_factory(default_format(), parse_rules(os.environ.get(ENV_ROLE_FORMATS, "")),
                        load_plan_env())


def quantizer_factory(role: Any) -> Any:
    """The factory Megatron-LM / CustomRecipe call: CUSTOM_QUANT_TYPE and LOWP_TE_ROLE_FORMATS
    read once per process."""
    return _from_env()(role)


def check_environment(env: Optional[Mapping[str, str]] = None) -> str:
    """Everything the factory will need, checked before a run: TE's version, CUSTOM_QUANT_TYPE
    and LOWP_TE_ROLE_FORMATS. Returns a summary line; FactoryError (one line) on a problem."""
    env = os.environ if env is None else env
    fmt = default_format(env)
    rules = parse_rules(env.get(ENV_ROLE_FORMATS, ""))
    plan = load_plan_env(env)
    if plan is not None:
        for f in plan.formats():
            _check_format(f, f"{ENV_PLAN} ({plan.source})")
    version = installed_te_version()
    check_te_version(version)
    from . import te_patches

    lacking = te_patches.missing()
    if lacking:
        raise FactoryError(f"Transformer Engine {version} lacks what {FACTORY_PATH} needs for "
                           f"{'; '.join(lacking)}")
    return (f"{FACTORY_PATH}: Transformer Engine {version}, {ENV_QUANT}={fmt}"
            + (f", {len(rules)} role rule(s)" if rules else "")
            + (f", {ENV_PLAN}={plan.source}" if plan is not None else ""))


def main(argv: Optional[list] = None) -> int:
    """``python -m te_integration.factory --check``: the launcher's check before torchrun."""

    from lowp_common import cli_entry

    @cli_entry("te_integration.factory")
    def run(argv):
        p = CommandParser(prog="python -m te_integration.factory",
                          description="Check that TE's custom recipe with our quantizer "
                                      "factory can run here (TE version, "
                                      "CUSTOM_QUANT_TYPE, LOWP_TE_ROLE_FORMATS).")
        p.add_argument("--check", action="store_true", required=True,
                       help="check and print a summary line (exit 2 with one line on a problem)")
        p.parse_args(argv)
        print(check_environment())
        return 0

    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
