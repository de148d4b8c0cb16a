"""Precision plans: which format each GEMM of each module computes in (one schema, one loader).

Why one loader: the same file drives our emulation of megatron-core linears
(``CUSTOM_QUANT_PLAN`` beside ``CUSTOM_QUANT_TYPE``), the Transformer Engine quantizer factory's
role rules, the conversion to Megatron-LM's ``--te-precision-config-file`` and what
``lowp-attribute`` writes; a second reader would drift from the first.

Schema (YAML or JSON)::

    default: fp8_e4m3            # optional: what no rule matches (else CUSTOM_QUANT_TYPE)
    rules:                       # first match wins
      - modules: 'mlp\\.linear_fc2$'  # optional: Python regex, re.search on the module path
        layers: [0, "2-3"]       # optional: 0-based transformer layer indexes / ranges
        roles: [dgrad, wgrad]    # optional: GEMM roles fprop / dgrad / wgrad (default: all)
        operands: [grad_output]  # optional: input / weight / grad_output (default: all)
        format: bf16             # a format or recipe of quant.recipes, or "hp" (unquantized)

A linear layer has three GEMMs (fprop, dgrad, wgrad: quant.gemm_plan); attention's Q·Kᵀ and
P·V are the fprop role of the ``core_attention`` module (their backward is not quantized).
A rule with ``layers`` never matches a module outside the transformer layers (the output
layer).

``operands`` selects GEMM operands (quant.vocabulary.LINEAR_OPERANDS). A caller that quantizes
one operand at a time names it (:meth:`PrecisionPlan.format_for`'s ``operand``; the TE
quantizer factory does: one slot per operand, each layout feeding one GEMM) and the rule then
matches that operand only. A caller that gives a whole GEMM one format names none (the
megatron-core emulation, Megatron-LM's per-module config): a rule with ``operands`` matches a
GEMM role through an operand the GEMM reads (quant.gemm_plan), so ``operands: [grad_output]``
puts all of dgrad and wgrad in its format there. A rule without ``operands`` matches every
operand, so a plan that names none means what it meant before operands existed.

The TE factory's ``LOWP_TE_ROLE_FORMATS`` is a compact spelling of these rules
(te_integration.factory.parse_rules), asked through the same :meth:`PrecisionPlan.format_for`.
Numerics configuration only: no Megatron, no capture.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from .gemm_plan import GEMM_OPERANDS
from .gemm_plan import LINEAR_GEMMS as ROLES
from .vocabulary import ENV_PLAN, LINEAR_OPERANDS, FormatNameError, check_format_name

_RULE_KEYS = ("modules", "layers", "roles", "operands", "format")
#: what a name a user writes in ``roles`` / ``operands`` may mean instead, said in the error
_HINTS = {"forward": " (the forward GEMM is called fprop)"}
#: a rule's list key -> what one of its names is, in the error
_WHAT = {"roles": "GEMM role", "operands": "operand"}
_TOP_KEYS = ("default", "rules", "version", "description", "made_by")


class PlanError(ValueError):
    """A plan is wrong; the message (one line) names the file, the rule and the fix."""


@dataclass(frozen=True)
class PlanSite:
    """One module a plan can address: its path, 0-based layer index, the GEMM roles it runs."""

    path: str
    layer: Optional[int]
    roles: tuple[str, ...] = ROLES


@dataclass(frozen=True)
class PlanRule:
    """modules (regex) x layers x roles x operands -> format; an absent condition matches
    everything (``operand`` None: the whole GEMM, matched through an operand it reads)."""

    fmt: str
    modules: Optional[str] = None
    layers: Optional[frozenset[int]] = None
    roles: tuple[str, ...] = ROLES
    operands: tuple[str, ...] = LINEAR_OPERANDS

    def matches(self, path: Optional[str], layer: Optional[int], role: str,
                operand: Optional[str] = None) -> bool:
        if role not in self.roles:
            return False
        if self.operands != LINEAR_OPERANDS and not self._reads(role, operand):
            return False
        if self.layers is not None and (layer is None or layer not in self.layers):
            return False
        return self.modules is None or (path is not None
                                        and re.search(self.modules, path) is not None)

    def _reads(self, role: str, operand: Optional[str]) -> bool:
        if operand is not None:
            return operand in self.operands
        return any(p.operand in self.operands for p in GEMM_OPERANDS[role])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.modules is not None:
            out["modules"] = self.modules
        if self.layers is not None:
            out["layers"] = sorted(self.layers)
        if self.roles != ROLES:
            out["roles"] = list(self.roles)
        if self.operands != LINEAR_OPERANDS:
            out["operands"] = list(self.operands)
        out["format"] = self.fmt
        return out


@dataclass(frozen=True)
class PrecisionPlan:
    """Ordered rules (first match wins) and the format for what none matches."""

    rules: tuple[PlanRule, ...]
    default: Optional[str] = None
    source: str = "plan"
    notes: Mapping[str, Any] = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def format_for(self, path: Optional[str], layer: Optional[int], role: str,
                   default: Optional[str] = None, operand: Optional[str] = None) -> Optional[str]:
        """The format of ``role`` of the module at ``path`` (layer ``layer``), of its operand
        ``operand`` where the caller quantizes one (None: the whole GEMM): the first matching
        rule's, else the plan's default, else ``default``; "hp" means unquantized."""
        key = (path, layer, role, default, operand)
        hit = self._cache.get(key, _MISS)
        if hit is _MISS:
            rule = self.rule_for(path, layer, role, operand)
            hit = (rule.fmt if rule is not None else None) or self.default or default
            self._cache[key] = hit
        return hit

    def rule_for(self, path: Optional[str], layer: Optional[int], role: str,
                 operand: Optional[str] = None) -> Optional[PlanRule]:
        """The first rule matching (None: the default decides); what a converter that cannot
        say everything a rule says (Megatron-LM's per-module config) checks."""
        return next((r for r in self.rules if r.matches(path, layer, role, operand)), None)

    def check_matches(self, sites: Iterable[PlanSite]) -> None:
        """PlanError naming the first rule that matches no module of ``sites``."""
        sites = list(sites)
        for i, rule in enumerate(self.rules):
            if not any(rule.matches(s.path, s.layer, role) for s in sites for role in s.roles):
                raise PlanError(f"{self.source}: rule {i + 1} ({_short(rule.to_dict())}) matches "
                                f"no GEMM of this model ({len(sites)} modules, e.g. "
                                f"{sites[0].path if sites else 'none'}); fix its modules / layers "
                                "/ roles / operands or remove it")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": 1}
        if self.default is not None:
            out["default"] = self.default
        out["rules"] = [r.to_dict() for r in self.rules]
        out.update({k: v for k, v in self.notes.items() if k in ("description", "made_by")})
        return out

    def formats(self) -> set[str]:
        return {r.fmt for r in self.rules} | ({self.default} if self.default else set())


_MISS = object()


def _short(d: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in d.items())


def check_format(name: Any, where: str) -> str:
    """A format / recipe name of quant.recipes (lower case) or "hp" (quant.vocabulary's one
    check); PlanError otherwise."""
    from .recipes import RECIPES

    try:
        return check_format_name(name, f"{where} format", RECIPES)
    except FormatNameError as exc:
        raise PlanError(str(exc)) from None


def _layers(value: Any, where: str) -> frozenset[int]:
    items = value if isinstance(value, (list, tuple)) else [value]
    out: set[int] = set()
    for item in items:
        if isinstance(item, bool):
            item = None
        if isinstance(item, int) and item >= 0:
            out.add(item)
            continue
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(item)) if item is not None else None
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise PlanError(f"{where}: layers {item!r} is not a 0-based layer index or a range "
                            "'a-b' (a <= b)")
        lo = int(m.group(1))
        out.update(range(lo, int(m.group(2) or lo) + 1))
    if not out:
        raise PlanError(f"{where}: layers is empty; omit it to mean every layer")
    return frozenset(out)


def _names(value: Any, where: str, key: str, valid: tuple[str, ...]) -> tuple[str, ...]:
    """``roles`` / ``operands``: a name or a list of names of ``valid``, in ``valid``'s order."""
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        name = str(item).strip().lower()
        if name not in valid:
            raise PlanError(f"{where}: {_WHAT[key]} {item!r} is unknown{_HINTS.get(name, '')}; use "
                            f"{', '.join(valid)}")
        out.append(name)
    if not out:
        raise PlanError(f"{where}: {key} is empty; omit it to mean {', '.join(valid)}")
    return tuple(n for n in valid if n in out)


def _rule(raw: Any, where: str) -> PlanRule:
    if not isinstance(raw, Mapping):
        raise PlanError(f"{where}: a rule is a mapping with keys {', '.join(_RULE_KEYS)}")
    unknown = sorted(set(raw) - set(_RULE_KEYS))
    if unknown:
        raise PlanError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; a rule has "
                        f"{', '.join(_RULE_KEYS)}")
    if "format" not in raw:
        raise PlanError(f"{where}: no format (a format or recipe name, or hp)")
    modules = raw.get("modules")
    if modules is not None:
        try:
            re.compile(str(modules))
        except re.error as exc:
            raise PlanError(f"{where}: modules {modules!r} is not a regular expression "
                            f"({exc})") from None
        modules = str(modules)
    given = {k: raw[k] for k in ("roles", "operands") if raw.get(k) is not None}
    return PlanRule(fmt=check_format(raw["format"], where), modules=modules,
                    layers=_layers(raw["layers"], where) if raw.get("layers") is not None
                    else None,
                    roles=_names(given["roles"], where, "roles", ROLES) if "roles" in given
                    else ROLES,
                    operands=_names(given["operands"], where, "operands", LINEAR_OPERANDS)
                    if "operands" in given else LINEAR_OPERANDS)


def plan_from_dict(raw: Any, source: str = "plan") -> PrecisionPlan:
    """A validated plan from parsed YAML / JSON (PlanError names ``source`` and the fix)."""
    if not isinstance(raw, Mapping):
        raise PlanError(f"{source}: a precision plan is a mapping with 'rules' (and optionally "
                        "'default')")
    unknown = sorted(set(map(str, raw)) - set(_TOP_KEYS))
    if unknown:
        raise PlanError(f"{source}: unknown key(s) {', '.join(unknown)}; a plan has "
                        f"{', '.join(_TOP_KEYS)}")
    rules_raw = raw.get("rules") or []
    if not isinstance(rules_raw, Sequence) or isinstance(rules_raw, (str, bytes)):
        raise PlanError(f"{source}: 'rules' must be a list of rules")
    rules = tuple(_rule(r, f"{source} rule {i + 1}") for i, r in enumerate(rules_raw))
    default = raw.get("default")
    default = check_format(default, f"{source} default") if default is not None else None
    if not rules and default is None:
        raise PlanError(f"{source}: the plan has no rules and no default; it would change "
                        "nothing")
    notes = {k: raw[k] for k in ("description", "made_by") if k in raw}
    return PrecisionPlan(rules, default, source, notes)


def load_plan(path: str | Path) -> PrecisionPlan:
    """Read a plan file (YAML, JSON is YAML too); PlanError (one line) on any problem."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{ENV_PLAN}={path}: cannot read the precision plan "
                        f"({type(exc).__name__}: {exc})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        line = " ".join(str(exc).split())
        raise PlanError(f"{path}: not valid YAML/JSON ({line[:200]})") from None
    return plan_from_dict(raw, str(path))


def dump_plan(plan: PrecisionPlan, header: str = "") -> str:
    """The plan as YAML text (a comment header first), what load_plan reads back."""
    import yaml

    lines = "".join(f"# {h}\n" for h in header.splitlines()) if header else ""
    return lines + yaml.safe_dump(plan.to_dict(), sort_keys=False)

