"""The auto-guard's settings, its conditions and its ladder of actions (no state).

Why rows: a condition is one :class:`Condition` (what it reads from an operand's reduced
statistics, its default threshold); an action is a rung of :func:`ladder` (the scaled variants of
the run's format that quant.formats defines, cheapest first, then high precision). Adding either
is one row; the guard (tensor_capture.guard) loops over them.

Settings (``guard:`` in TENSOR_SAVE_CONFIG, or ``TENSOR_SAVE_GUARD=on`` for the defaults)::

    guard:
      budget: 0.25            # share of GEMM FLOPs the guard may move to high precision
      hold: 2                 # consecutive iterations a condition must hold before an action
      warmup: 0               # iterations not judged at the start of the run
      actions: [scale, hp]    # rungs allowed, cheapest first (scale: a scaled variant)
      conditions:             # threshold per condition; null turns one off
        sqnr_deficit_db: 15   # dB below the format's Gaussian baseline (quant.format_loss)
        flush_share: 0.5      # a gradient's nonzero elements the format flushed to zero
        saturation_share: 0.001   # elements beyond the format's largest value
        nonfinite: 1          # NaN / Inf the quantization made of finite values
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from quant.vocabulary import FALSE_WORDS, TRUE_WORDS

#: the statistics the guard keeps per quantized operand, summed over micro-batches and ranks
STATS = ("elements", "nonzero", "flushed", "made_nonfinite", "saturated", "signal", "noise")
ELEMENTS, NONZERO, FLUSHED, MADE_NONFINITE, SATURATED, SIGNAL, NOISE = range(len(STATS))

ACTION_SCALE = "scale"       # a scaled variant of the operand's format (per tensor, per block)
ACTION_HP = "hp"             # the GEMM in high precision (counts against the budget)
ACTIONS = (ACTION_SCALE, ACTION_HP)


class GuardError(ValueError):
    """A guard setting is wrong; the message (one line) names it and the fix."""


@dataclass(frozen=True)
class Condition:
    """One condition over an operand's reduced statistics: ``value(row, baseline_db)`` compared
    with the threshold (``>=`` means failing)."""

    name: str
    default: float
    value: Callable[[list[float], float], float]
    meaning: str
    operands: tuple[str, ...] | None = None     # judged on these operands only (None: all)

    def judges(self, operand: str) -> bool:
        return self.operands is None or operand in self.operands


def _share(num: int, den: int) -> Callable[[list[float], float], float]:
    return lambda row, _baseline: row[num] / row[den] if row[den] > 0 else 0.0


def row_sqnr_db(row: list[float]) -> float:
    """The SQNR of an operand's reduced statistics (quant.metrics' one definition)."""
    from quant.metrics import sqnr_of_sums

    return sqnr_of_sums(row[SIGNAL], row[NOISE])


def _sqnr_deficit(row: list[float], baseline_db: float) -> float:
    """dB below the baseline; 0 for an operand with no signal (nothing to lose)."""
    return baseline_db - row_sqnr_db(row) if row[SIGNAL] > 0 else 0.0


CONDITIONS: tuple[Condition, ...] = (
    Condition("nonfinite", 1.0, lambda row, _b: row[MADE_NONFINITE],
              "NaN / Inf the quantization made of finite values"),
    Condition("saturation_share", 1e-3, _share(SATURATED, ELEMENTS),
              "share of elements beyond the format's largest value"),
    Condition("sqnr_deficit_db", 15.0, _sqnr_deficit,
              "dB of SQNR below the format's Gaussian baseline (quant.format_loss)"),
    # elements count for gradients (each carries learning signal however small, as
    # lowp-diagnose's run_format_loss judges them); for activations and weights what a flush
    # costs is its energy, which sqnr_deficit_db judges (a block format flushes half of a
    # SwiGLU output's elements at its Gaussian SQNR)
    Condition("flush_share", 0.5, _share(FLUSHED, NONZERO),
              "share of a gradient's nonzero elements flushed to zero", ("grad_output",)),
)
CONDITION_NAMES = tuple(c.name for c in CONDITIONS)
_KEYS = ("budget", "hold", "warmup", "actions", "conditions")


@dataclass(frozen=True)
class GuardSettings:
    """The guard's settings, validated (:func:`parse_guard`)."""

    budget: float = 0.25
    hold: int = 2
    warmup: int = 0
    actions: tuple[str, ...] = ACTIONS
    thresholds: Mapping[str, float | None] = field(
        default_factory=lambda: {c.name: c.default for c in CONDITIONS})

    def to_dict(self) -> dict[str, Any]:
        """The settings as ``guard:`` writes them (what :func:`parse_guard` reads back)."""
        return {"budget": self.budget, "hold": self.hold, "warmup": self.warmup,
                "actions": list(self.actions), "conditions": dict(self.thresholds)}

    def active(self) -> list[tuple[Condition, float]]:
        """The conditions that judge, with their thresholds, in table order."""
        return [(c, t) for c in CONDITIONS if (t := self.thresholds.get(c.name)) is not None]


_ON = set(TRUE_WORDS)
_OFF = {*FALSE_WORDS, ""}


def parse_guard(name: str, value: Any) -> GuardSettings | None:
    """``guard`` from YAML (a mapping, or on / off) or TENSOR_SAVE_GUARD (on / off)."""
    if value is None or value is False:
        return None
    if value is True:
        return GuardSettings()
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _ON:
            return GuardSettings()
        if text in _OFF:
            return None
        raise GuardError(f"{name}={value!r}: use on or off (or a 'guard:' mapping in "
                         "TENSOR_SAVE_CONFIG for its settings)")
    _known(name, value, _KEYS, "key", "on / off or a mapping")
    d = GuardSettings
    return GuardSettings(budget=_budget(name, value.get("budget", d.budget)),
                         hold=_count(f"{name}.hold", value.get("hold", d.hold), 1),
                         warmup=_count(f"{name}.warmup", value.get("warmup", d.warmup), 0),
                         actions=_actions(name, value.get("actions", list(ACTIONS))),
                         thresholds=_thresholds(name, value.get("conditions") or {}))


def _known(where: str, value: Any, known: tuple[str, ...], what: str, shape: str) -> None:
    """GuardError unless ``value`` is a mapping whose keys are all ``known``."""
    if not isinstance(value, Mapping):
        raise GuardError(f"{where} must be {shape} with {what}s {', '.join(known)}")
    unknown = sorted(set(map(str, value)) - set(known))
    if unknown:
        raise GuardError(f"{where}: unknown {what}(s) {', '.join(unknown)}; known: "
                         f"{', '.join(known)}")


def _budget(name: str, value: Any) -> float:
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = float("nan")
    if not 0.0 <= share <= 1.0:
        raise GuardError(f"{name}.budget={value!r} must be a share of GEMM FLOPs from 0 to 1 "
                         "(0.25: at most a quarter of them in high precision)")
    return share


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GuardError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


def _actions(name: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value or [])
    bad = [a for a in items if a not in ACTIONS]
    if bad or not items:
        raise GuardError(f"{name}.actions={value!r}: choose from {', '.join(ACTIONS)} "
                         "(cheapest first)")
    return tuple(a for a in ACTIONS if a in items)


def _thresholds(name: str, value: Any) -> dict[str, float | None]:
    _known(f"{name}.conditions", value, CONDITION_NAMES, "condition", "a mapping (threshold)")
    out: dict[str, float | None] = {c.name: c.default for c in CONDITIONS}
    for key, raw in value.items():
        if raw is None:
            out[key] = None
            continue
        try:
            out[key] = float(raw)
        except (TypeError, ValueError):
            raise GuardError(f"{name}.conditions.{key}={raw!r} must be a number (or null: off)"
                             ) from None
    if all(v is None for v in out.values()):
        raise GuardError(f"{name}.conditions: every condition is off; the guard would never act")
    return out


# -- the ladder ----------------------------------------------------------------------------------
#: scaled variants, cheapest first: one float32 scale per tensor, then one per block
_SCALING_ORDER = ("tensor", "mx", "nvfp4")


def ladder(fmt: str, actions: tuple[str, ...]) -> list[str]:
    """The formats the guard may move a GEMM of format ``fmt`` to, cheapest first: the scaled
    variants of its element format with finer scaling than its own (quant.formats: same
    ``element``), then "hp" (when allowed). A recipe of quant.recipes (TE's) has no scaled
    variant here: only "hp"."""
    from quant.formats import FORMATS
    from quant.vocabulary import HIGH_PRECISION, HIGH_PRECISION_NAMES

    if fmt in HIGH_PRECISION_NAMES:
        return []
    steps: list[str] = []
    spec = FORMATS.get(fmt)
    if ACTION_SCALE in actions and spec is not None:
        element = spec.element or spec.name
        own = _SCALING_ORDER.index(spec.scaling) if spec.scaling in _SCALING_ORDER else -1
        finer = [s for s in FORMATS.values() if (s.element or s.name) == element
                 and s.scaling in _SCALING_ORDER and _SCALING_ORDER.index(s.scaling) > own]
        steps += [s.name for s in sorted(finer, key=lambda s: _SCALING_ORDER.index(s.scaling))]
    if ACTION_HP in actions:
        steps.append(HIGH_PRECISION)
    return steps


def check_format(settings: GuardSettings, fmt: str | None, where: str) -> None:
    """Refuse, before training, a guard that could never act on ``fmt``: no emulated format, or
    one with no scaled variant while high precision is not allowed."""
    if not fmt:
        raise GuardError(f"{where}: the guard acts on an emulated format; set CUSTOM_QUANT_TYPE "
                         "(or CUSTOM_QUANT_PLAN) too")
    if not ladder(fmt, settings.actions):
        raise GuardError(f"{where}: {fmt} has no scaled variant and actions "
                         f"{list(settings.actions)} exclude high precision, so the guard could "
                         "never act; add hp to guard.actions or choose another format")
