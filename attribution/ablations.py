"""Ablations: which part of a Llama-style model to keep in high precision, and what it costs.

An ablation is a set of *atoms* (unit, GEMM role): units are each layer's attention (linear_qkv,
linear_proj and core_attention's Q·Kᵀ / P·V, fprop only), each layer's MLP (linear_fc1,
linear_fc2) and the output layer. Its cost is the share of the model's GEMM FLOPs it keeps in
high precision (per token; every role of a linear costs the same 2·in·out). Its plan keeps those
atoms in the reference format and leaves the rest in the format under test
(quant.precision_plan, the file CUSTOM_QUANT_PLAN reads).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from quant.precision_plan import ROLES, PlanRule, PrecisionPlan
from quant.vocabulary import DGRAD, FPROP, WGRAD

ATTENTION, MLP, OUTPUT = "attention", "mlp", "output_layer"
#: unit kind -> regex on the module path (megatron-core GPTModel's names)
UNIT_MODULES = {ATTENTION: r"\.self_attention\.", MLP: r"\.mlp\.", OUTPUT: r"^output_layer$"}
BACKWARD = (DGRAD, WGRAD)

Atom = tuple[str, Optional[int], str]      # (unit kind, layer or None, role)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    seq_length: int
    vocab_size: int

    def units(self) -> list[tuple[str, Optional[int]]]:
        return ([(k, i) for i in range(self.num_layers) for k in (ATTENTION, MLP)]
                + [(OUTPUT, None)])

    def atoms(self) -> frozenset[Atom]:
        return frozenset((k, i, r) for k, i in self.units() for r in self.roles_of(k))

    @staticmethod
    def roles_of(kind: str) -> tuple[str, ...]:
        return ROLES

    def flops(self, atom: Atom) -> float:
        """GEMM FLOPs per token of one atom (multiply-add = 2)."""
        kind, _, role = atom
        h, f = self.hidden_size, self.ffn_hidden_size
        kv = h // self.num_attention_heads * self.num_query_groups
        if kind == ATTENTION:
            linears = h * (h + 2 * kv) + h * h
            core = 2 * self.seq_length * h if role == FPROP else 0   # Q·Kᵀ and P·V
            return 2.0 * (linears + core)
        if kind == MLP:
            return 2.0 * (h * 2 * f + f * h)        # gated fc1 (2 f outputs) and fc2
        return 2.0 * h * self.vocab_size


@dataclass(frozen=True)
class Ablation:
    """A named set of atoms kept in high precision."""

    name: str
    atoms: frozenset

    def describe(self, shape: ModelShape) -> dict:
        """{"roles": [...], "layers": "all" | [...], "modules": ...} for the JSON."""
        roles = sorted({a[2] for a in self.atoms}, key=ROLES.index)
        kinds = sorted({a[0] for a in self.atoms})
        layers = sorted({a[1] for a in self.atoms if a[1] is not None})
        all_layers = (layers == list(range(shape.num_layers))
                      and any(a[0] == OUTPUT for a in self.atoms))
        return {"roles": roles, "layers": "all" if all_layers else layers,
                "modules": "all" if set(kinds) == set(UNIT_MODULES) else kinds}


def cost(atoms: Iterable[Atom], shape: ModelShape) -> float:
    """Share of all GEMM FLOPs the atoms keep in high precision."""
    total = sum(shape.flops(a) for a in shape.atoms())
    return sum(shape.flops(a) for a in atoms) / total if total else 0.0


def _select(shape: ModelShape, kinds=None, layers=None, roles=ROLES,
            output: bool = True) -> frozenset:
    out = set()
    for k, i in shape.units():
        if kinds is not None and k not in kinds:
            continue
        if k == OUTPUT and not output:
            continue
        if layers is not None and k != OUTPUT and i not in layers:
            continue
        out.update((k, i, r) for r in roles)
    return frozenset(out)


def standard_ablations(shape: ModelShape) -> list[Ablation]:
    """Each GEMM role alone, the backward GEMMs together, then layer groups: first / last k
    layers, attention, MLP, the output layer and each block of layers (duplicates dropped)."""
    n = shape.num_layers
    k = max(1, round(n / 8))
    block = max(1, n // 4)
    cands = [Ablation(f"{r} (all layers)", _select(shape, roles=(r,))) for r in ROLES]
    cands.append(Ablation("backward: dgrad+wgrad (all layers)", _select(shape, roles=BACKWARD)))
    cands += [
        Ablation(f"first {k} layer{'s' * (k > 1)}", _select(shape, layers=range(k), output=False)),
        Ablation(f"last {k} layer{'s' * (k > 1)}",
                 _select(shape, layers=range(n - k, n), output=False)),
        Ablation("attention (all layers)", _select(shape, kinds=(ATTENTION,))),
        Ablation("MLP (all layers)", _select(shape, kinds=(MLP,))),
        Ablation("output layer", _select(shape, kinds=(OUTPUT,))),
    ]
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        name = f"layer {lo}" if hi - lo == 1 else f"layers {lo}-{hi - 1}"
        cands.append(Ablation(name, _select(shape, layers=range(lo, hi), output=False)))
    seen, out = set(), []
    for a in cands:
        if a.atoms and a.atoms not in seen:
            seen.add(a.atoms)
            out.append(a)
    return out


def splits(atoms: frozenset, shape: ModelShape) -> list[tuple[frozenset, frozenset]]:
    """The ways to halve a set for bisection, in the order tried: by GEMM role (fprop |
    backward, then dgrad | wgrad), by layers (first half | second half, the output layer with
    the second), by unit kind (the first kind | the rest); empty when one atom is left."""
    out = []
    roles = sorted({a[2] for a in atoms}, key=ROLES.index)
    if len(roles) > 1:
        first = {FPROP} if FPROP in roles else {roles[0]}
        lo = frozenset(a for a in atoms if a[2] in first)
        out.append((lo, atoms - lo))
    layers = sorted({a[1] for a in atoms if a[1] is not None})
    has_out = any(a[1] is None for a in atoms)
    if len(layers) > 1 or (layers and has_out):
        cut = set(layers[: max(1, len(layers) // 2)]) if len(layers) > 1 else set(layers)
        lo = frozenset(a for a in atoms if a[1] in cut)
        out.append((lo, atoms - lo))
    kinds = sorted({a[0] for a in atoms})
    if len(kinds) > 1:
        lo = frozenset(a for a in atoms if a[0] == kinds[0])
        if (lo, atoms - lo) not in out:
            out.append((lo, atoms - lo))
    return out


def name_of(atoms: frozenset, shape: ModelShape) -> str:
    d = Ablation("", atoms).describe(shape)
    mods = "all modules" if d["modules"] == "all" else "+".join(d["modules"])
    if d["layers"] == "all":
        where = ", all layers"
    elif d["layers"]:
        where = f", layer{'s' * (len(d['layers']) > 1)} {','.join(map(str, d['layers']))}"
    else:
        where = ""                       # the output layer alone
    return f"{'+'.join(d['roles'])} of {mods}{where}"


def plan_for(atoms: Iterable[Atom], fmt: str, reference: str, shape: ModelShape,
             source: str = "plan") -> PrecisionPlan:
    """The precision plan keeping ``atoms`` in ``reference`` and the rest in ``fmt``: one rule
    per (unit kind, role set) with its layers; a group covering every layer and unit needs no
    condition."""
    atoms = frozenset(atoms)
    by_kind_roles: dict[tuple[str, tuple[str, ...]], set] = {}
    per_unit: dict[tuple[str, Optional[int]], set] = {}
    for k, i, r in atoms:
        per_unit.setdefault((k, i), set()).add(r)
    for (k, i), rs in per_unit.items():
        key = (k, tuple(r for r in ROLES if r in rs))
        by_kind_roles.setdefault(key, set()).add(i)
    rules: list[PlanRule] = []
    full = {(k, i) for k, i in shape.units()}
    role_sets = {roles for (_, roles) in by_kind_roles}
    if len(role_sets) == 1 and set(per_unit) == full:
        rules.append(PlanRule(reference, roles=next(iter(role_sets))))
    else:
        for (k, roles), layers in sorted(by_kind_roles.items(),
                                         key=lambda kv: (kv[0][0], kv[0][1])):
            lay = None if k == OUTPUT or set(layers) == set(range(shape.num_layers)) \
                else frozenset(layers)
            rules.append(PlanRule(reference, modules=UNIT_MODULES[k], layers=lay, roles=roles))
    return PrecisionPlan(tuple(rules), default=fmt, source=source)
