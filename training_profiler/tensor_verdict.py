"""The verdict of ``analyze_tensor``: one rule table from the numbers of its report to the risk
level, the reasons, the suggestion and the list of formats where nothing was found.

Why a table: each verdict is read by exactly one rule, and the level is the highest any rule
gives. Whether a format suits the tensor is ONE judgment, ``quant.format_loss``: the tensor's
SQNR in the format against the format's own SQNR on Gaussian data of the same shape along the
same axis. A ratio rule (flush above 1 % is high) called every Gaussian HIGH in mxfp4 / nvfp4
and fp8's subnormal range "underflow" although nothing was lost; values now count by what they
lose. The overflow / underflow / flush-to-zero ratios (``quant.analysis``' definitions) stay in
the report as the evidence.

A LOW verdict is a claim that every ratio is below 0.1 %; with fewer nonzero finite values than
``1 / MEDIUM_THRESHOLD`` one value alone is above that, so the verdict is CANNOT JUDGE instead
(found risks still stand). An all-zero tensor has no magnitudes to judge.
docs/profiler.md lists the table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from quant.analysis import MEDIUM_THRESHOLD
from quant.format_loss import MARGIN_HIGH_DB, MARGIN_MEDIUM_DB, loss_severity
from quant.formats import FORMATS
from quant.vocabulary import Severity

#: the risk levels a verdict prints (quant.vocabulary.Severity's labels)
LOW, MEDIUM, HIGH = (s.label for s in (Severity.LOW, Severity.MEDIUM, Severity.HIGH))
CANNOT_JUDGE = "CANNOT JUDGE"
#: quant's ratio / loss severity -> risk level (a ratio with nothing to say is a LOW risk)
SEVERITY_LEVEL = {Severity.NONE.word: LOW, Severity.MEDIUM.word: MEDIUM, Severity.HIGH.word: HIGH}
#: fewest nonzero finite values for which "below 0.1 %" can hold with one value affected
MIN_VALUES_FOR_LOW = math.ceil(1 / MEDIUM_THRESHOLD)
# bf16 keeps 8 significant bits: a channel 2**8 times smaller than another falls below half an
# ulp of it in a bf16 sum and is lost; 2**4 already costs half of its bits.
_BF16_BITS = FORMATS["bf16"].mbits + 1
HIGH_RATIO = 2.0 ** _BF16_BITS
MEDIUM_RATIO = 2.0 ** (_BF16_BITS // 2)


# --------------------------------------------------------------------------------------
# graders: a number -> a level, and the words for the bound each level needs


@dataclass(frozen=True)
class LossGrade:
    """dB below the format's Gaussian baseline, graded by ``quant.format_loss.loss_severity``
    (the project's one judgment of a format's loss)."""

    def level(self, value: float) -> str:
        return SEVERITY_LEVEL[loss_severity(-value, 0.0)]

    def bound(self, level: str) -> str:
        return {HIGH: f"more than {MARGIN_HIGH_DB:g} dB below",
                MEDIUM: f"more than {MARGIN_MEDIUM_DB:g} dB below"}[level]


@dataclass(frozen=True)
class ThresholdGrade:
    """``value >= threshold`` for the first (threshold, level) pair that holds."""

    steps: tuple[tuple[float, str], ...]

    def level(self, value: float) -> str:
        return next((lvl for thr, lvl in self.steps if value >= thr), LOW)

    def bound(self, level: str) -> str:
        return next(f">= {thr:g}" for thr, lvl in self.steps if lvl == level)


@dataclass(frozen=True)
class AnyGrade:
    """Any nonzero count is ``level``."""

    at: str = HIGH

    def level(self, value: float) -> str:
        return self.at if value > 0 else LOW

    def bound(self, level: str) -> str:
        return "any"


# --------------------------------------------------------------------------------------
# the rule table


@dataclass(frozen=True)
class RiskRule:
    """One rule: which numbers of the report it reads, how it grades them, what it says.

    ``read(report)`` yields (subject, value) pairs: subject None for the whole tensor, else a
    format name. ``reason`` is formatted with ``subjects`` ("fp8_e4m3 (99.9%), hifp8 (20%)"),
    ``bound`` and the report's keys; ``suggestion`` likewise.
    """

    id: str
    evidence: str
    read: Callable[[dict], Iterable[tuple[Optional[str], float]]]
    grade: Any
    reason: str
    suggestion: str
    percent: bool = True       # values shown as percentages in the reason


def _format_rows(key: str, only: Callable[[str], bool] = lambda name: True):
    def read(r: dict) -> Iterable[tuple[Optional[str], float]]:
        return [(name, row[key]) for name, row in r["formats"].items() if only(name)]
    return read


def _is_dtype(name: str) -> bool:
    """Training dtypes (bf16, fp16, ...): their cast makes an overflowing value Inf."""
    return FORMATS[name].torch_dtype is not None if name in FORMATS else False


RULES: tuple[RiskRule, ...] = (
    RiskRule("nonfinite", "nan_count + inf_count",
             lambda r: [(None, r["nan_count"] + r["inf_count"])], AnyGrade(HIGH),
             "{nan_count} NaN and {inf_count} Inf values",
             "Find where the non-finite values start (@watch_training names the first layer).",
             percent=False),
    RiskRule("dim_imbalance", "dim_ratio (largest / smallest channel absmax)",
             lambda r: [(None, r["dim_ratio"])],
             ThresholdGrade(((HIGH_RATIO, HIGH), (MEDIUM_RATIO, MEDIUM))),
             "dimension {dim_small} is {dim_ratio:.3g}x smaller than dimension {dim_big} "
             "({bound}; 256 = below half a bf16 ulp of it in a sum)",
             "Dimension {dim_small} has a much smaller range than dimension {dim_big}: do "
             "reductions over this tensor in FP32 (or normalise the dimensions separately) "
             "before casting it to low precision.", percent=False),
    RiskRule("dtype_overflow", "formats[dtype].overflow_ratio (bf16, fp16: the cast gives Inf)",
             _format_rows("overflow_ratio", _is_dtype), AnyGrade(HIGH),
             "values overflow to Inf in {subjects}",
             "Values exceed {names}' range and become Inf: scale the tensor down or keep it in "
             "FP32."),
    RiskRule("format_loss", "formats[F].deficit_db (SQNR below the format's Gaussian baseline, "
                            "quant.format_loss)",
             _format_rows("deficit_db"), LossGrade(),
             "{subjects} lose more than Gaussian data of this shape does ({bound})",
             "Quantizing to {names} loses clearly more than these formats lose on "
             "well-conditioned data (overflow, flush to zero or subnormal precision, see the "
             "format rows): scale the tensor first (a per-tensor or block-scaled format) or keep "
             "it in a format where no rule fired.", percent=False),
)

#: the LOW suggestion: only said when no rule fired and there are enough values
SAFE_SUGGESTION = ("No rule fired (non-finite values, dimension ratio, overflow to Inf, loss "
                   "against the format's Gaussian baseline): low-precision casting to {names} "
                   "looks safe for this tensor.")


@dataclass(frozen=True)
class Precondition:
    """When the evidence cannot support a LOW verdict: ``applies(report)`` and what to say."""

    id: str
    applies: Callable[[dict], bool]
    reason: str


PRECONDITIONS: tuple[Precondition, ...] = (
    Precondition("no_finite_values", lambda r: r["finite_count"] == 0,
                 "none of the {numel} values is finite"),
    Precondition("all_zero", lambda r: r["finite_count"] > 0 and r["nonzero_finite"] == 0,
                 "all {finite_count} finite values are zero: there are no magnitudes to judge"),
    Precondition("too_few_values", lambda r: 0 < r["nonzero_finite"] < MIN_VALUES_FOR_LOW,
                 "only {nonzero_finite} nonzero finite values: one value is "
                 "{one_value_pct:.2g}% of them, above the 0.1% severity bound, so 'no risk "
                 "found' cannot be told from one value's luck (needs >= "
                 + str(MIN_VALUES_FOR_LOW) + ")"),
)


def _pct(v: float) -> str:
    return f"{v * 100:.3g}%"


def judge(report: dict) -> dict[str, Any]:
    """The verdict of an analyze_tensor report: risk_level, reasons, suggestion, findings,
    safe_formats (formats no per-format rule graded above LOW), cannot_judge (reasons)."""
    ctx = dict(report, block_size=report["block_dynamic_range"]["block_size"],
               one_value_pct=100.0 / max(report["nonzero_finite"], 1))
    findings, flagged = [], set()
    for rule in RULES:
        graded: dict[str, list[tuple[Optional[str], float]]] = {}
        for subject, value in rule.read(report):
            lvl = rule.grade.level(value)
            if lvl != LOW:
                graded.setdefault(lvl, []).append((subject, value))
                if subject is not None:
                    flagged.add(subject)
        for lvl in (HIGH, MEDIUM):
            if lvl not in graded:
                continue
            hits = graded[lvl]
            names = [s for s, _ in hits if s is not None]
            subjects = ", ".join(f"{s} ({_pct(v) if rule.percent else f'{v:g}'})"
                                 for s, v in hits if s is not None)
            words = dict(ctx, subjects=subjects, names=", ".join(names),
                         bound=rule.grade.bound(lvl))
            findings.append({"rule": rule.id, "level": lvl, "subjects": names,
                             "values": [v for _, v in hits],
                             "reason": rule.reason.format(**words),
                             "suggestion": rule.suggestion.format(**words)})
    checked = list(report["formats"])
    safe = [f for f in checked if f not in flagged]
    blocked = [p.reason.format(**ctx) for p in PRECONDITIONS if p.applies(report)]
    if findings:
        level = max((f["level"] for f in findings), key=Severity.of)
    else:
        level = CANNOT_JUDGE if blocked else LOW
    top = [f for f in findings if f["level"] == level]
    if top:
        suggestion = " ".join(dict.fromkeys(f["suggestion"] for f in top))
    elif blocked:
        suggestion = "Cannot judge: " + "; ".join(blocked) + "."
    else:
        suggestion = SAFE_SUGGESTION.format(names=", ".join(safe) or "(no formats tested)")
    return {"risk_level": level, "reasons": [f"{f['level']}: {f['reason']}" for f in findings],
            "findings": findings, "suggestion": suggestion,
            "safe_formats": safe if not blocked else [], "cannot_judge": blocked}
