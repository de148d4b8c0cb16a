"""``run_format_loss``: what the run's own format (``CUSTOM_QUANT_TYPE``) does to every GEMM
operand it quantizes, constant or not: the fraction it flushes to zero and the fraction it
saturates, from the capture's statistics (``stats.range[quant_type]``, whose counts follow
quant.analysis' one definition of flush and overflow), with gradients weighed as gradients.

Rule (docs/diagnose.md): per operand tensor and iteration, the largest ratio over ranks and
micro-batches. Every operand is judged by the fraction of its energy (sum of x^2) flushed, from
its captured log2 histogram: what a GEMM's output, or for a gradient the update, loses. A
gradient (``grad_output``, the operand of dgrad and wgrad) is also judged by the fraction of its
elements flushed (within GRADIENT_BINADES of its largest), at most MEDIUM: a flushed element is
a lost contribution to its weight's update, but hifp8 flushing up to 74 % of a gradient's
elements with under 0.01 % of its energy trains within seed noise of bf16, while fp8_e4m3 flushing all
of the energy of the MLP gradients trails it by 1.76 nats (docs/diagnose.md). Saturation of any
operand by its overflow ratio. Each through quant.analysis.severity (HIGH above 1 %, MEDIUM above
0.1 %). Operands with the same problem, direction and severity are one finding, named by the
earliest (iteration, then execution order); the others are listed.

Scaled formats (MX, NVFP4, ``*_tensor``) have no element range in the capture and are judged by
``format_loss`` instead. The same SQL on DuckDB and Spark (tensor_viz.diagnose.sql_dialect). A flight
recorder's summaries count the flushed and saturated elements in the run's format but keep no
histogram: there the energy is judged by the flushed elements' ratio.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from tensor_capture.stats_read import fraction_below
from tensor_viz.columnar import SQL_HP
from tensor_viz.diagnose.rules import (
    HIGH,
    MEDIUM,
    OPERANDS,
    TENSOR_KEY,
    Inputs,
    RunFinding,
    Trend,
    _label,
    _rows,
    _trend_dict,
    positions,
    ratio_trend,
)
from tensor_viz.diagnose.sql_dialect import named_struct

KIND = "run_format_loss"
#: a flushed gradient element counts when it is within this many binades of the tensor's
#: largest (float32's 24-bit significand): one further below vanishes beside it in any sum (and
#: in Adam's update, beside eps), so bf16 flushing float32's subnormal gradients is no loss
GRADIENT_BINADES = 24
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
    """One captured operand tensor (TENSOR_KEY) over iterations, in the run's format."""

    key: tuple
    fmt: str
    series: list[dict[str, Any]] = field(default_factory=list)

    @property
    def operation(self) -> str:
        return self.key[TENSOR_KEY.index("operation")]

    @property
    def operand(self) -> str:
        return OPERANDS[(self.operation, self.key[TENSOR_KEY.index("tensor_name")])]

    @property
    def gradient(self) -> bool:
        return self.operand == "grad_output"

    @property
    def gemms(self) -> list[str]:
        return gemms(self.operation, self.operand)

    @property
    def label(self) -> str:
        return _label(dict(zip(TENSOR_KEY, self.key)))


def _query(con: Any, inp: Inputs) -> list[dict[str, Any]]:
    """Per operand tensor and iteration, its worst ratios (and the histogram of its record that
    flushes most: ties broken by rank, micro-batch, order, so both engines pick the same one).
    A folder with a flight recorder's summaries reads the narrow table, which they fill: their
    flush and saturation counts are of the run's format, and they keep no histogram."""
    pairs = ", ".join(f"('{o}', '{t}')" for o, t in OPERANDS)
    key = ", ".join(TENSOR_KEY)
    if inp.nested is None or inp.summary_rows:
        return _rows(con, f"""
            SELECT {key}, iteration, any_value(quant_type) AS fmt, max(flush) AS flush,
                   max(overflow) AS overflow, max(underflow) AS underflow, max(absmax) AS absmax
            FROM {inp.narrow}
            WHERE variant = {SQL_HP} AND quant_type IS NOT NULL AND nan_count + inf_count = 0
              AND (operation, tensor_name) IN ({pairs}) AND flush IS NOT NULL
            GROUP BY {key}, iteration ORDER BY iteration""")
    rng = "stats.range[quant_type]"
    order = named_struct(con, {"f": f"{rng}.flush_to_zero_ratio", "r": "rank",
                               "s": "coalesce(sample_idx, -1)", "c": "coalesce(counter, -1)"})
    return _rows(con, f"""
        SELECT {key}, iteration, any_value(quant_type) AS fmt,
               max({rng}.flush_to_zero_ratio) AS flush, max({rng}.overflow_ratio) AS overflow,
               max({rng}.underflow_ratio) AS underflow, max(stats.absmax) AS absmax,
               max_by(stats.log2_hist, {order}) AS hist
        FROM {inp.nested}
        WHERE coalesce(variant, {SQL_HP}) = {SQL_HP} AND quant_type IS NOT NULL
          AND coalesce(stats.nan_count, 0) + coalesce(stats.inf_count, 0) = 0
          AND (operation, tensor_name) IN ({pairs}) AND {rng}.flush_to_zero_ratio IS NOT NULL
        GROUP BY {key}, iteration ORDER BY iteration""")


def _has_hist(row: dict[str, Any]) -> bool:
    return bool((row.get("hist") or {}).get("counts"))


def energy_flushed(row: dict[str, Any], fmt: str) -> float:
    """The fraction of an operand's energy the format flushes, from the histogram of its worst
    record; the flushed elements' ratio where there is none (a recorder's summary)."""
    if not _has_hist(row):
        return row["flush"] or 0.0
    return fraction_below(row["hist"], _qa().cast_limits(fmt).flush_to, energy=True)


def gradient_flushed(row: dict[str, Any], fmt: str) -> float:
    """The fraction of a gradient's elements the format flushes, counting those within
    GRADIENT_BINADES of its largest (from the histogram of its worst record; the captured ratio
    when there is no histogram)."""
    if not _has_hist(row):
        return row["flush"] or 0.0
    return fraction_below(row["hist"], _qa().cast_limits(fmt).flush_to, within=GRADIENT_BINADES)


def _judge(op: _Operand, row: dict[str, Any], problem: str) -> tuple[str, float]:
    """(quant.analysis severity, the ratio judged) of one iteration."""
    if problem == "saturation":
        return _qa().severity(row["overflow"] or 0.0), row["overflow"] or 0.0
    qa = _qa()
    energy = energy_flushed(row, op.fmt)
    if op.gradient:     # HIGH by the energy (the update) lost, MEDIUM by the elements too
        by_energy = qa.severity(energy)
        if by_energy == qa.SEVERITY_HIGH:
            return by_energy, energy
        by_elements = qa.severity(gradient_flushed(row, op.fmt))
        worse = max((by_energy, by_elements), key=qa.SEVERITIES.index)
        return (qa.SEVERITY_MEDIUM if worse != qa.SEVERITY_NONE else worse), energy
    return qa.severity(energy), energy


@dataclass
class _Hit:
    op: _Operand
    problem: str
    level: str              # HIGH / MEDIUM
    onset: int              # first iteration at that level
    at_onset: dict[str, Any]
    worst: float
    iterations: int         # iterations at that level
    trend: Trend | None = None


def _hits(ops: list[_Operand]) -> list[_Hit]:
    """Per operand and problem: its worst level over iterations, from the first iteration at
    that level, with its rise toward quant.analysis' 1 % when steady (range_drift's trend rule)."""
    out = []
    qa = _qa()
    to_level = {qa.SEVERITY_HIGH: HIGH, qa.SEVERITY_MEDIUM: MEDIUM}
    for op in ops:
        for problem in ("flush", "saturation"):
            judged = [(_judge(op, r, problem), r) for r in op.series]
            trend = ratio_trend(f"{problem} ratio", [(r["iteration"], v) for (_, v), r in judged])
            levels = [lv for (lv, _), _ in judged]
            if all(lv == qa.SEVERITY_NONE for lv in levels):
                continue        # (a trend needs a rise of 0.1 %: it has reached MEDIUM)
            level = qa.SEVERITY_HIGH if qa.SEVERITY_HIGH in levels else qa.SEVERITY_MEDIUM
            at = [(r, v) for (lv, v), r in judged if lv == level]
            out.append(_Hit(op, problem, to_level[level], at[0][0]["iteration"], at[0][0],
                            max(v for _, v in at), len(at), trend))
    return out


def _remedy(hit: _Hit, members: list[_Hit]) -> str:
    """What to try, for the problem, the operand and the format (docs/diagnose.md)."""
    from quant.formats import get_format

    fmt, qa = hit.op.fmt, _qa()
    roles = sorted({g for m in members for g in m.op.gemms})
    modules = sorted({m.op.key[0] for m in members if m.op.key[0]})
    where = ("" if len(modules) > 3 else
             f"modules: '{'|'.join(re.escape(m) + '$' for m in modules)}', ")
    keep = "fp32" if get_format(fmt).bits >= 16 else "bf16"
    plan = (f"keep these GEMMs in {keep} with a precision plan (CUSTOM_QUANT_PLAN, rule "
            f"{{{where}roles: [{', '.join(roles)}], format: {keep}}})")
    scaled = ("" if keep == "fp32" else
              f"a scaled format ({' or '.join(SCALED_FORMATS)}) instead of unscaled {fmt}, ")
    if not hit.op.gradient:
        return f"Give {hit.op.label} a scale: {scaled or 'a loss or input scale, '}or {plan}."
    if hit.problem == "saturation":
        return (f"The gradients exceed {fmt}'s range: a smaller (or dynamic) loss scale, "
                f"{scaled}or {plan}.")
    limits = qa.cast_limits(fmt)
    absmax = hit.at_onset["absmax"] or 0.0
    scale = ((f"a loss scale (up to {2 ** math.floor(math.log2(limits.max_normal / absmax)):g} "
              f"keeps this gradient's largest value {absmax:.3g} below {fmt}'s max "
              f"{limits.max_normal:g}), ") if absmax > 0 else "a loss scale, ")
    wide = ""
    if keep == "bf16" and fmt != GRADIENT_FORMAT:
        wide = f"{GRADIENT_FORMAT} for gradients, "
        if _has_hist(hit.at_onset):
            lost = fraction_below(hit.at_onset["hist"], qa.cast_limits(GRADIENT_FORMAT).flush_to)
            wide = (f"{GRADIENT_FORMAT} for gradients (it would still flush {100 * lost:.1f}% "
                    "of this one), ")
    return f"Scale the gradients: {scale}{scaled}{wide}or {plan}."


def run_format_loss(con: Any, inp: Inputs) -> list[RunFinding]:
    """The findings of the run's own format on the GEMM operands (module docstring)."""
    src = inp.narrow
    pairs = ", ".join(f"('{o}', '{t}')" for o, t in OPERANDS)
    if not con.execute(f"""SELECT count(*) FROM (SELECT 1 FROM {src} WHERE flush IS NOT NULL
            AND (operation, tensor_name) IN ({pairs}) LIMIT 1) AS x""").fetchone()[0]:
        return []       # no operand in an unscaled run format: nothing to read the dataset for
    ops: dict[tuple, _Operand] = {}
    for row in _query(con, inp):
        key = tuple(row[k] for k in TENSOR_KEY)
        if key not in ops:
            try:
                _qa().cast_limits(row["fmt"])
            except (KeyError, ValueError):
                continue
            ops[key] = _Operand(key, row["fmt"])
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


def _finding(members: list[_Hit], pos: dict[tuple, float]) -> RunFinding:
    hit, r = members[0], members[0].at_onset
    op = hit.op
    where = dict(zip(TENSOR_KEY, op.key), iteration=hit.onset, rank=None, sample_idx=None)
    saturates = hit.problem == "saturation"
    energy = energy_flushed(r, op.fmt)
    value, measure = ((r["overflow"], "of its elements saturated") if saturates else
                      (gradient_flushed(r, op.fmt), f"of its elements ({100 * energy:.2f}% of "
                       "its energy) flushed to zero") if op.gradient else
                      (energy, "of its energy flushed to zero"))
    t = hit.trend
    rising = ("" if t is None else f"; rising {100 * t.first:.2f}% -> {100 * t.last:.2f}%, "
              f"projected to reach {100 * t.limit:g}% at iteration {t.crossing:.0f}")
    summary = (f"The run's format {op.fmt} {'saturates' if saturates else 'flushes'} "
               f"{'gradient ' if op.gradient else ''}{op.label} (operand {op.operand} of "
               f"{'/'.join(op.gemms)}) from iteration {hit.onset}: {100 * value:.2f}% {measure} "
               f"(underflow {100 * (r['underflow'] or 0):.2f}%; at worst {100 * hit.worst:.2f}% "
               f"{'of its elements' if saturates else 'of its energy'}, "
               f"{hit.iterations} iteration(s) at this level{rising})"
               + (f"; {len(members) - 1} other operand(s) too" if len(members) > 1 else "") + ".")
    evidence = {
        "format": op.fmt, "problem": hit.problem, "gemms": op.gemms, "operand": op.operand,
        "gradient": op.gradient, "flush_to_zero_ratio": r["flush"],
        "flushed_within_binades": (gradient_flushed(r, op.fmt) if op.gradient else None),
        "underflow_ratio": r["underflow"], "overflow_ratio": r["overflow"],
        "energy_flushed": energy, "absmax": r["absmax"], "worst": hit.worst,
        "iterations_at_level": hit.iterations,
        "trend": None if t is None else _trend_dict(t),
        "operands": [{"tensor": m.op.label, "onset": m.onset, "gemms": m.op.gemms,
                      "worst": m.worst} for m in members[1:11]],
        "operands_at_level": len(members),
    }
    return RunFinding(KIND, hit.level, summary, where, evidence,
                   "index.html: overflow_analysis (flush / overflow per tensor); numerics_map",
                   _remedy(hit, members), onset=hit.onset, position=pos.get(op.key, math.inf))
