"""``run_format_loss``: what the run's own format (``CUSTOM_QUANT_TYPE``) does to every GEMM
operand it quantizes, constant or not: the fraction it flushes to zero and the fraction it
saturates, from the capture's statistics (``stats.range[quant_type]``, whose counts follow
quant.analysis' one definition of flush and overflow), with gradients weighed as gradients.

Rule (docs/diagnose.md): per operand tensor and iteration, the largest ratio over ranks and
micro-batches. A gradient (``grad_output``, the operand of dgrad and wgrad) is judged by the
fraction of its elements flushed: a flushed gradient element is a lost update. A forward operand
(input, weight, query, key, value, probs) is judged by the fraction of its energy flushed (small
values contribute little to a GEMM's output; the histogram gives it). Saturation of any operand
by its overflow ratio. Each through quant.analysis.severity (HIGH above 1 %, MEDIUM above
0.1 %). Operands with the same problem, direction and severity are one finding, named by the
earliest (iteration, then execution order); the others are listed.

Scaled formats (MX, NVFP4, ``*_tensor``) have no element range in the capture and are judged by
``format_loss`` instead. DuckDB only (map access and arg_max of a struct), like format_loss.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from tensor_capture.stats_read import fraction_below
from tensor_viz.diagnose_rules import (
    HIGH,
    MEDIUM,
    TENSOR_KEY,
    Finding,
    _label,
    _rows,
    positions,
    source,
)

KIND = "run_format_loss"
#: captured (operation, tensor_name) -> the operand's name in quant.gemm_plan.PLAN (the keys
#: are diagnose_rules.CAST)
OPERANDS = {("forward", "input"): "input", ("forward", "weight"): "weight",
            ("backward", "grad_output"): "grad_output", ("backward", "weight"): "weight",
            ("forward", "query"): "query", ("forward", "key"): "key",
            ("forward", "value"): "value", ("forward", "attention_probs"): "probs"}
#: the unscaled format with the wider range a gradient's remedy names
GRADIENT_FORMAT = "fp8_e5m2"
#: scaled formats that give an operand a scale of its own (quant.formats)
SCALED_FORMATS = ("fp8_e4m3_tensor", "mxfp8")


def _qa() -> Any:
    """quant.analysis (the one definition of flush, overflow and severity), imported when there
    is something to judge: it imports torch, which a capture without emulation never needs."""
    from quant import analysis

    return analysis


def gemms(operation: str, operand: str) -> list[str]:
    """The GEMMs (quant.gemm_plan) that quantize this captured operand: a forward record feeds
    fprop (and, for the input, wgrad, which reuses it); a backward record dgrad / wgrad."""
    from quant.gemm_plan import PLAN  # torch: only once there is something to judge

    skip = "dgrad" if operation == "forward" else "fprop"
    return [p.gemm for p in PLAN if p.operand == operand and p.gemm != skip]


@dataclass
class _Operand:
    key: tuple
    fmt: str
    operation: str
    gradient: bool
    series: list[dict[str, Any]] = field(default_factory=list)


def _query(con: Any, src: str) -> list[dict[str, Any]]:
    pairs = ", ".join(f"('{o}', '{t}')" for o, t in OPERANDS)
    key = ", ".join(TENSOR_KEY)
    rng = "stats.range[quant_type]"
    return _rows(con, f"""
        SELECT {key}, iteration, any_value(quant_type) AS fmt,
               max({rng}.flush_to_zero_ratio) AS flush, max({rng}.overflow_ratio) AS overflow,
               max({rng}.underflow_ratio) AS underflow, max(stats.absmax) AS absmax,
               min(stats.absmax) AS min_absmax,
               arg_max(stats.log2_hist, {rng}.flush_to_zero_ratio) AS hist,
               count(*) AS records
        FROM {src}
        WHERE coalesce(variant, 'hp') = 'hp' AND quant_type IS NOT NULL
          AND coalesce(stats.nan_count, 0) + coalesce(stats.inf_count, 0) = 0
          AND (operation, tensor_name) IN ({pairs}) AND {rng}.flush_to_zero_ratio IS NOT NULL
        GROUP BY {key}, iteration ORDER BY iteration""")


def _judge(op: _Operand, row: dict[str, Any], problem: str) -> tuple[str, float]:
    """(quant.analysis severity, the ratio judged) of one iteration."""
    if problem == "saturation":
        return _qa().severity(row["overflow"] or 0.0), row["overflow"] or 0.0
    if op.gradient:
        return _qa().severity(row["flush"] or 0.0), row["flush"] or 0.0
    lost = fraction_below(row["hist"], _qa().cast_limits(op.fmt).flush_to, energy=True)
    row["energy_flushed"] = lost
    return _qa().severity(lost), lost


@dataclass
class _Hit:
    op: _Operand
    problem: str
    level: str              # quant.analysis severity at its worst
    onset: int              # first iteration at that level
    at_onset: dict[str, Any]
    worst: float
    iterations: int         # iterations at that level


def _hits(ops: list[_Operand]) -> list[_Hit]:
    out = []
    for op in ops:
        for problem in ("flush", "saturation"):
            judged = [(_judge(op, r, problem), r) for r in op.series]
            levels = [j[0][0] for j in judged]
            if all(lv == _qa().SEVERITY_NONE for lv in levels):
                continue
            level = _qa().SEVERITY_HIGH if _qa().SEVERITY_HIGH in levels else _qa().SEVERITY_MEDIUM
            at = [(r, j[1]) for j, r in judged if j[0] == level]
            out.append(_Hit(op, problem, level, at[0][0]["iteration"], at[0][0],
                            max(v for _, v in at), len(at)))
    return out


def _remedy(hit: _Hit, members: list[_Hit]) -> str:
    fmt, label = hit.op.fmt, _label(dict(zip(TENSOR_KEY, hit.op.key)))
    roles = sorted({g for m in members for g in gemms(m.op.operation, OPERANDS[(
        m.op.operation, m.op.key[TENSOR_KEY.index("tensor_name")])])})
    modules = sorted({m.op.key[0] for m in members if m.op.key[0]})
    where = ("" if len(modules) > 3 else
             f"modules: '{'|'.join(re.escape(m) + '$' for m in modules)}', ")
    plan = (f"keep these GEMMs in high precision with a precision plan (CUSTOM_QUANT_PLAN, rule "
            f"{{{where}roles: [{', '.join(roles)}], format: bf16}})")
    scaled = " or ".join(SCALED_FORMATS)
    if hit.problem == "saturation":
        return (f"Give {label} a scale: a scaled format ({scaled}) instead of unscaled {fmt}, or "
                f"{plan}.")
    if hit.op.gradient:
        absmax = hit.at_onset["absmax"] or 0.0
        scale = (2 ** math.floor(math.log2(_qa().cast_limits(fmt).max_normal / absmax))
                 if absmax > 0 else None)
        wide = fraction_below(hit.at_onset["hist"], _qa().cast_limits(GRADIENT_FORMAT).flush_to)
        return ((f"Scale the gradients: a loss scale (up to {scale:g} keeps this gradient's "
                 f"largest value {absmax:.3g} below {fmt}'s max {_qa().cast_limits(fmt).max_normal:g}), "
                 if scale else "Scale the gradients (a loss scale), ")
                + f"or a scaled format for them ({scaled}); {GRADIENT_FORMAT} for gradients "
                f"would still flush {100 * wide:.1f}% of this one; or {plan}.")
    return (f"Give {label} a scale (a scaled format: {scaled}) instead of unscaled {fmt}, or "
            f"{plan}.")


def run_format_loss(con: Any, state: Any, src: str, view: Any = None) -> list[Finding]:
    """The findings of the run's own format on the GEMM operands (module docstring)."""
    del view
    ops: dict[tuple, _Operand] = {}
    for row in _query(con, source(state)):
        key = tuple(row[k] for k in TENSOR_KEY)
        if key not in ops:
            fmt = row["fmt"]
            try:
                _qa().cast_limits(fmt)
            except (KeyError, ValueError):
                continue
            ops[key] = _Operand(key, fmt, row["operation"], row["tensor_name"] == "grad_output")
        ops[key].series.append(row)
    hits = _hits(list(ops.values()))
    if not hits:
        return []
    pos = positions(con, src)
    groups: dict[tuple, list[_Hit]] = {}
    for h in hits:
        groups.setdefault((h.problem, h.op.gradient, h.level), []).append(h)
    return [_finding(sorted(m, key=lambda h: (h.onset, pos.get(h.op.key, math.inf))), pos)
            for m in groups.values()]


def _finding(members: list[_Hit], pos: dict[tuple, float]) -> Finding:
    hit = members[0]
    op = hit.op
    name = op.key[TENSOR_KEY.index("tensor_name")]
    roles = gemms(op.operation, OPERANDS[(op.operation, name)])
    where = dict(zip(TENSOR_KEY, op.key), iteration=hit.onset, rank=None, sample_idx=None)
    r = hit.at_onset
    what = ("saturated" if hit.problem == "saturation" else "flushed to zero")
    measure = ("of its elements" if hit.problem == "saturation" or op.gradient
               else "of its energy")
    value = (r["overflow"] if hit.problem == "saturation" else
             r["flush"] if op.gradient else r.get("energy_flushed", 0.0))
    sev = HIGH if hit.level == _qa().SEVERITY_HIGH else MEDIUM
    summary = (f"The run's format {op.fmt} {'saturates' if hit.problem == 'saturation' else 'flushes'}"
               f" {'gradient ' if op.gradient else ''}{_label(where)} (operand {OPERANDS[(op.operation, name)]}"
               f" of {'/'.join(roles)}) from iteration {hit.onset}: {100 * value:.2f}% {measure} "
               f"{what} (underflow {100 * (r['underflow'] or 0):.2f}%, worst "
               f"{100 * hit.worst:.2f}%, in {hit.iterations} iteration(s))"
               + (f"; {len(members) - 1} other operand(s) too" if len(members) > 1 else "") + ".")
    evidence = {
        "format": op.fmt, "problem": hit.problem, "gemms": roles,
        "operand": OPERANDS[(op.operation, name)], "gradient": op.gradient,
        "flush_to_zero_ratio": r["flush"], "underflow_ratio": r["underflow"],
        "overflow_ratio": r["overflow"], "energy_flushed": fraction_below(
            r["hist"], _qa().cast_limits(op.fmt).flush_to, energy=True),
        "absmax": r["absmax"], "worst": hit.worst, "iterations_at_level": hit.iterations,
        "operands": [{"tensor": _label(dict(zip(TENSOR_KEY, m.op.key))), "onset": m.onset,
                      "gemms": gemms(m.op.operation, OPERANDS[(
                          m.op.operation, m.op.key[TENSOR_KEY.index("tensor_name")])]),
                      "worst": m.worst} for m in members[1:11]],
        "operands_at_level": len(members),
    }
    return Finding(KIND, sev, summary, where, evidence,
                   "index.html: overflow_analysis (flush / overflow per tensor); numerics_map",
                   _remedy(hit, members), onset=hit.onset, position=pos.get(op.key, math.inf))
