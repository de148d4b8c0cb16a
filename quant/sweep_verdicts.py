"""The scale sweep's verdicts (stability, recommendation, its position, the range of clean levels,
the overflow/underflow advice, why a plot is sparse) from one rule table.

Why a table: a sweep of one level printed "MSE is stable across scaling factors", "a balanced
middle ground between overflow and underflow" and a recommended range, none of which one point
can show. Here every phrase is a :class:`VerdictRule` row (the data file sweep_verdicts.json:
phrases are data, the conditions code) naming the conditions it needs
(:data:`CONDITIONS`, each a named predicate over the sweep's numbers); for each topic the first
row whose conditions all hold speaks (topics in :data:`ALL_MATCH` say every row that holds).
Rows that cannot be judged (one level, all values zero, every level alike) come first, so a
claim is only made when the numbers can carry it. Pure data and functions: nothing prints;
``quant_tools.scaling_report`` lays the phrases out, ``tensor_viz.scaling_plots`` draws the
plot notes. docs/scaling.md lists the table.

Overflow / underflow counts and severities are ``quant.analysis``' definitions (through the
sweep's ``LevelResult``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .analysis import SEVERITY_HIGH, SEVERITY_NONE, severity_label

#: a curve needs this many points to show a shape; fewer and the plots say why
MIN_CURVE_LEVELS = 3
#: MSE max/min above this: "varies significantly"
MSE_RATIO_VARIES = 2.0
#: cosine delta bounds: varies significantly / moderately sensitive
COSINE_DELTA = (0.05, 0.01)
#: PSNR delta bounds in dB: large / moderate
PSNR_DELTA = (20.0, 10.0)
#: position of the recommended level between the smallest (0) and largest (1) exponent swept
POSITION_ENDS = (0.2, 0.8)
#: the levels' severities: quant.analysis' names as reports print them
NONE, HIGH = severity_label(SEVERITY_NONE), severity_label(SEVERITY_HIGH)


# --------------------------------------------------------------------------------------
# conditions: named predicates over the evidence


def _finite_n(ev: dict, m: str) -> int:
    return ev["stats"][m]["n"] if ev["stats"].get(m) else 0


def _spread(ev: dict, m: str, field: str) -> float:
    """A metric's spread over the levels; NaN (so every threshold test is false) when no level
    gave that metric a finite value, e.g. a tensor whose values overflow at every exponent."""
    st = ev["stats"].get(m)
    return st[field] if st else math.nan


CONDITIONS: dict[str, tuple[str, Callable[[dict], bool]]] = {
    "one_level": ("only one distinct exponent was swept", lambda ev: ev["n_levels"] == 1),
    "all_zero": ("every finite value is zero", lambda ev: ev["all_zero"]),
    "all_tie": ("every level gives the same value of every metric", lambda ev: ev["all_tie"]),
    "psnr_judgeable": ("at least 2 levels have a finite PSNR", lambda ev: _finite_n(ev, "psnr") >= 2),
    "mse_varies": (f"MSE max/min above {MSE_RATIO_VARIES:g}",
                   lambda ev: _spread(ev, "mse", "ratio") > MSE_RATIO_VARIES),
    "cos_varies": (f"cosine delta above {COSINE_DELTA[0]:g}",
                   lambda ev: _spread(ev, "cosine_similarity", "delta") > COSINE_DELTA[0]),
    "cos_moderate": (f"cosine delta above {COSINE_DELTA[1]:g}",
                     lambda ev: _spread(ev, "cosine_similarity", "delta") > COSINE_DELTA[1]),
    "psnr_large": (f"PSNR delta above {PSNR_DELTA[0]:g} dB",
                   lambda ev: _spread(ev, "psnr", "delta") > PSNR_DELTA[0]),
    "psnr_moderate": (f"PSNR delta above {PSNR_DELTA[1]:g} dB",
                      lambda ev: _spread(ev, "psnr", "delta") > PSNR_DELTA[1]),
    "recommended": ("a level was recommended", lambda ev: ev["rec"] is not None),
    "near_large_end": (f"the recommended level is in the top {1 - POSITION_ENDS[1]:.0%} of the "
                       "swept exponents", lambda ev: ev["rec"]["position"] > POSITION_ENDS[1]),
    "near_small_end": (f"the recommended level is in the bottom {POSITION_ENDS[0]:.0%} of the "
                       "swept exponents", lambda ev: ev["rec"]["position"] <= POSITION_ENDS[0]),
    "overflow_below": ("a smaller exponent overflows more than the recommended level",
                       lambda ev: ev["rec"]["more_overflow_below"]),
    "underflow_above": ("a larger exponent underflows more than the recommended level",
                        lambda ev: ev["rec"]["more_underflow_above"]),
    "clean_levels": ("some level has overflow and underflow severity NONE",
                     lambda ev: ev["n_clean"] > 0),
    "clean_contiguous": ("the clean levels are consecutive", lambda ev: ev["clean_contiguous"]),
    "one_clean": ("exactly one level is clean", lambda ev: ev["n_clean"] == 1),
    "any_high": ("some level has HIGH overflow or underflow", lambda ev: ev["any_high"]),
    "any_overflow": ("some level has MEDIUM/HIGH overflow", lambda ev: ev["n_overflow_levels"] > 0),
    "any_underflow": ("some level has MEDIUM/HIGH underflow",
                      lambda ev: ev["n_underflow_levels"] > 0),
    "sparse": (f"fewer than {MIN_CURVE_LEVELS} levels were swept",
               lambda ev: ev["n_levels"] < MIN_CURVE_LEVELS),
}


@dataclass(frozen=True)
class VerdictRule:
    """One phrase and the conditions it needs (names of :data:`CONDITIONS`; ``!name`` = not)."""

    topic: str
    id: str
    needs: tuple[str, ...]
    phrase: str

    def holds(self, ev: dict) -> bool:
        return all((not CONDITIONS[n[1:]][1](ev)) if n.startswith("!") else CONDITIONS[n][1](ev)
                   for n in self.needs)


#: the thresholds phrases quote ({mse_ratio_varies:g} ...), besides the evidence
PHRASE_CONSTANTS = {"mse_ratio_varies": MSE_RATIO_VARIES}
#: the rule table (quant/sweep_verdicts.json: phrases are data, edited without touching code)
RULES_FILE = Path(__file__).with_name("sweep_verdicts.json")


def _load_rules(path: Path = RULES_FILE) -> tuple[VerdictRule, ...]:
    """The rows of the rule table, in order; every condition a row names must exist."""
    with open(path, encoding="utf-8") as fh:
        rows = json.load(fh)["rules"]
    rules = tuple(VerdictRule(r["topic"], r["id"], tuple(r["needs"]), r["phrase"]) for r in rows)
    unknown = {n.lstrip("!") for r in rules for n in r.needs} - set(CONDITIONS)
    if unknown:
        raise ValueError(f"{path}: unknown conditions {sorted(unknown)}")
    return rules


RULES: tuple[VerdictRule, ...] = _load_rules()

#: topics where every row that holds speaks (the others: the first row that holds)
ALL_MATCH = frozenset({"advice"})
TOPICS = tuple(dict.fromkeys(r.topic for r in RULES))


def evidence(levels: Sequence[Any], scores: Sequence[float], stats: dict[str, Any],
             all_zero: bool, sparse_reason: str, rec_index: Optional[int]) -> dict[str, Any]:
    """The numbers the conditions and phrases read, from the sweep's levels (``LevelResult``:
    scale_exp, metrics, overflow/underflow ratios and severities), the composite scores and
    ``stability_analysis``' statistics."""
    exps = [lv.scale_exp for lv in levels]
    pct = lambda v: 100.0 * v  # noqa: E731
    metric_rows = [tuple(lv.metrics[k] for k in sorted(lv.metrics)) for lv in levels]
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))  # noqa: E731
    all_tie = all(all(same(x, y) for x, y in zip(row, metric_rows[0])) for row in metric_rows)
    clean = [i for i, lv in enumerate(levels)
             if lv.overflow_severity == NONE and lv.underflow_severity == NONE]
    least = min(levels, key=lambda lv: (lv.overflow_ratio + lv.underflow_ratio,
                                        lv.overflow_ratio)) if levels else None
    ev: dict[str, Any] = {
        "n_levels": len(set(exps)), "lo": min(exps), "hi": max(exps), "all_zero": all_zero,
        "all_tie": len(levels) > 1 and all_tie, "sparse_reason": sparse_reason, "stats": stats,
        "n_clean": len(clean), "clean_contiguous": bool(clean) and clean == list(
            range(clean[0], clean[-1] + 1)),
        "clean_lo": exps[clean[0]] if clean else math.nan,
        "clean_hi": exps[clean[-1]] if clean else math.nan,
        "clean_list": ", ".join(f"{exps[i]:.2f}" for i in clean),
        "least": least.scale_exp, "least_over_pct": pct(least.overflow_ratio),
        "least_under_pct": pct(least.underflow_ratio),
        "any_high": any(HIGH in (lv.overflow_severity, lv.underflow_severity) for lv in levels),
        "n_overflow_levels": sum(lv.overflow_severity != NONE for lv in levels),
        "n_underflow_levels": sum(lv.underflow_severity != NONE for lv in levels),
        "max_over_pct": pct(max(lv.overflow_ratio for lv in levels)),
        "max_under_pct": pct(max(lv.underflow_ratio for lv in levels)),
        "rec": None,
    }
    for key, m in (("mse_ratio", "mse"), ("cos_delta", "cosine_similarity"),
                   ("psnr_delta", "psnr")):
        st = stats.get(m)
        ev[key] = (st["ratio"] if key == "mse_ratio" else st["delta"]) if st else math.nan
    if rec_index is not None:
        lv = levels[rec_index]
        span = ev["hi"] - ev["lo"]
        ev["rec"] = {
            "position": 0.5 if span == 0 else (lv.scale_exp - ev["lo"]) / span,
            "more_overflow_below": any(o.scale_exp < lv.scale_exp and
                                       o.overflow_ratio > lv.overflow_ratio for o in levels),
            "more_underflow_above": any(o.scale_exp > lv.scale_exp and
                                        o.underflow_ratio > lv.underflow_ratio for o in levels)}
        ev.update(position=ev["rec"]["position"], rec_over_pct=pct(lv.overflow_ratio),
                  rec_under_pct=pct(lv.underflow_ratio))
    return ev


@dataclass(frozen=True)
class Verdict:
    """The phrase of one topic and the row that gave it."""

    topic: str
    rule: str
    text: str


def judge(ev: dict[str, Any], topics: Sequence[str] = TOPICS) -> dict[str, list[Verdict]]:
    """For each topic, the first row whose conditions hold (every such row for
    :data:`ALL_MATCH` topics). A row with an empty phrase says nothing (``SweepResult.says``
    leaves it out) but still records which row held."""
    out: dict[str, list[Verdict]] = {}
    for topic in topics:
        said = []
        for rule in (r for r in RULES if r.topic == topic):
            if rule.holds(ev):
                said.append(Verdict(topic, rule.id, rule.phrase.format(**PHRASE_CONSTANTS, **ev)))
                if topic not in ALL_MATCH:
                    break
        out[topic] = said
    return out


def decide(levels: Sequence[Any], scores: Sequence[float], stats: dict[str, Any],
           all_zero: bool, sparse_reason: str, best: int) -> tuple[Optional[int], dict]:
    """(index of the recommended level or None, every topic's verdicts). ``best`` is the
    composite-best level; it is recommended only when the recommendation row that holds is
    ``best_composite`` (not one level, not all zeros, not every level alike)."""
    ev = evidence(levels, scores, stats, all_zero, sparse_reason, None)
    (row,) = judge(ev, ("recommendation",))["recommendation"]
    if row.rule != "best_composite":
        return None, judge(ev)
    return best, judge(evidence(levels, scores, stats, all_zero, sparse_reason, best))
