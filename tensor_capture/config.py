"""Capture configuration: environment variables plus an optional YAML file, validated once.

Why validate up front: a typo in a 10-hour run's capture settings should fail in the first
second with one line naming the setting and the fix, not silently capture nothing.

Precedence: defaults < YAML file < environment variables < explicit keyword overrides.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from quant.formats import WHATIF_FORMATS
from quant.vocabulary import (
    ENV_CONFIG,
    ENV_DIR,
    ENV_ENABLED,
    ENV_GUARD,
    ENV_ITERATION,
    ENV_MODE,
    ENV_PLAN,
    ENV_QUANT,
    ENV_TENSORBOARD,
    ENV_WHATIF,
    FALSE_WORDS,
    HIGH_PRECISION,
    TRUE_WORDS,
    FormatNameError,
    check_format_name,
    is_high_precision,
)

from .schema import LAYER_TYPES, OPERATIONS, PHASES

_FALSE = (*FALSE_WORDS, "")          # an empty value is off
#: capture modes: "capture" saves the selected iterations; "recorder" keeps mergeable statistics of
#: every iteration in a ring and captures in full only after a trigger (tensor_capture.recorder.flight)
MODE_CAPTURE, MODE_RECORDER = "capture", "recorder"
MODES = (MODE_CAPTURE, MODE_RECORDER)
#: the recorder's host memory when the config names none (ring + summaries waiting to be written)
RECORDER_MEMORY = 256 * 2**20
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


#: what-if numerics analyse at most this many elements of a tensor (strided rows, whole blocks):
#: five formats cost about 30x the statistics per element on a CPU
WHATIF_MAX_ELEMENTS = 1 << 14

#: share of wall time what-if numerics may use (wall seconds of the writer's what-if jobs over
#: seconds since the first): what-if adds about 1.1x to stats-only capture (docs/capture.md)
WHATIF_BUDGET = 0.1

# max_iterations / byte_budget: "unlimited" in YAML; None means "the default bound"
# (tensor_capture.budget). inf compares like a limit that is never reached.
UNLIMITED = math.inf
_UNLIMITED_WORDS = ("unlimited", "inf")


class ConfigError(ValueError):
    """A capture setting is invalid; the message names it and says how to fix it."""


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean: use true/false (or 1/0)")


def _int(name: str, value: Any, minimum: int | None = None, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be an integer")
    try:
        out = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be an integer") from None
    if minimum is not None and out < minimum:
        raise ConfigError(f"{name}={out} must be >= {minimum}")
    return out


def _unlimited(value: Any) -> bool:
    return value == UNLIMITED or str(value).strip().lower() in _UNLIMITED_WORDS


def _max_iterations(name: str, value: Any) -> int | float | None:
    if value is not None and _unlimited(value):
        return UNLIMITED
    return _int(name, value, minimum=1, allow_none=True)


def _share(name: str, value: Any) -> float:
    """A positive fraction of wall time, or "unlimited" (inf)."""
    if _unlimited(value):
        return UNLIMITED
    try:
        out = float(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be a share of wall time such as 0.25, "
                          "or 'unlimited'") from None
    if not 0 < out <= 1:
        raise ConfigError(f"{name}={out} must be in (0, 1], or 'unlimited'")
    return out


def _size(name: str, value: Any) -> int | float | None:
    if value is None:
        return None
    if _unlimited(value):
        return UNLIMITED
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{name}={value} must be >= 0")
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"{name}={value!r} is not a size: write bytes, e.g. '500MB', '2GiB', "
                          "or 'unlimited'")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _choices(name: str, value: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value or ())
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise ConfigError(f"{name}={list(items)!r}: choose from {list(allowed)}")
    return tuple(items)


def _int_list(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, (int, str)) else tuple(value)
    return tuple(_int(name, v, minimum=0) for v in items)


def valid_quant_names() -> list[str]:
    """Every recipe name (quant.recipes: Transformer Engine's recipes, then each format)."""
    from quant.recipes import RECIPES  # the numerics core; capture cannot emulate without it

    return list(RECIPES)


def _format(name: str, value: Any, known: Any = None, high_precision: bool = False) -> str:
    """quant.vocabulary's one check of a format name, as a ConfigError."""
    try:
        return check_format_name(value, name, known, high_precision=high_precision)
    except FormatNameError as exc:
        raise ConfigError(str(exc)) from None


def _quant(name: str, value: Any) -> str | None:
    """A recipe or format name; a high-precision spelling (hp, fp32, none) emulates nothing and
    keeps its own label (it goes into file names); empty is unset."""
    text = "" if value is None else str(value).strip()
    if not text:
        return None
    try:
        names = valid_quant_names()
    except ImportError as exc:
        raise ConfigError(f"{name}={text!r} needs the quant package, which failed to import: {exc}") from None
    fmt = _format(ENV_QUANT, text, names, high_precision=True)
    return text.lower() if fmt == HIGH_PRECISION else fmt


def _formats(name: str, value: Any) -> tuple[str, ...]:
    """Formats to measure (range statistics): a name or a list."""
    items = (value,) if isinstance(value, str) else tuple(value or ())
    return tuple(_format(name, v) for v in items)


def _whatif(name: str, value: Any) -> tuple[str, ...]:
    """What-if formats: a list, or a comma-separated string; "none" / empty turns them off,
    "default" is quant.formats.WHATIF_FORMATS."""
    if isinstance(value, str):
        word = value.strip().lower()
        value = () if word in ("", "none", "off") else (
            WHATIF_FORMATS if word == "default" else value.split(","))
    items = tuple(str(v).strip() for v in (value or ()) if str(v).strip())
    return tuple(dict.fromkeys(_format(name, v) for v in items))


def _positive_float(name: str, value: Any) -> float:
    try:
        out = float(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be a number") from None
    if not out > 0 or not math.isfinite(out):
        raise ConfigError(f"{name}={out} must be a positive number")
    return out


def _mode(name: str, value: Any) -> str:
    text = str(value).strip().lower()
    if text not in MODES:
        raise ConfigError(f"{name}={value!r} is not a capture mode: use {' or '.join(MODES)}")
    return text


def _dir(name: str, value: Any) -> str:
    if not str(value).strip():
        raise ConfigError(f"{name} is empty: give a directory")
    return str(value)


def _regex(name: str, value: Any) -> str | None:
    if value is None:
        return None
    try:
        re.compile(str(value))
    except re.error as exc:
        raise ConfigError(f"{name}={value!r} is not a regular expression ({exc})") from None
    return str(value)


def _names(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(str(v) for v in ([value] if isinstance(value, str) else value))


def _guard(name: str, value: Any):
    from .guard_rules import GuardError, parse_guard

    try:
        return parse_guard(name, value)
    except GuardError as exc:
        raise ConfigError(str(exc)) from None


def _at_least(minimum: int, allow_none: bool = False) -> Callable[[str, Any], int | None]:
    """The parser of an integer setting with a lower bound."""
    return lambda name, value: _int(name, value, minimum=minimum, allow_none=allow_none)


def _one_of(allowed: tuple[str, ...]) -> Callable[[str, Any], tuple[str, ...]]:
    """The parser of a setting that lists some of ``allowed``."""
    return lambda name, value: _choices(name, value, allowed)


def _optional_dir(name: str, value: Any) -> str | None:
    return None if value is None or not str(value).strip() else _dir(name, value)


def _optional_text(name: str, value: Any) -> str | None:
    return str(value).strip() or None if value is not None else None


def _recorder_memory(name: str, value: Any) -> int | float:
    return RECORDER_MEMORY if value is None else _size(name, value)


def setting(default: Any, parse: Callable[[str, Any], Any], env: str | None = None) -> Any:
    """A capture setting: its default, its parser ``(name shown in errors, raw value) -> value``
    (ConfigError on a bad value) and the environment variable it is read from, if any (a name
    of quant.vocabulary). Its YAML key is the field's name."""
    return field(default=default, metadata={"parse": parse, "env": env})


@dataclass(frozen=True)
class CaptureConfig:
    """Every capture setting, each one field that carries its parser and environment variable:
    a new setting is one field here (docs/architecture.md, "A capture setting")."""

    enabled: bool = setting(False, _bool, ENV_ENABLED)
    save_dir: str = setting("./tensor_logs", _dir, ENV_DIR)
    iteration: int = setting(0, _at_least(0), ENV_ITERATION)   # the starting iteration
    quant_type: str | None = setting(None, _quant, ENV_QUANT)      # None: no emulation
    quant_plan: str | None = setting(None, _optional_text, ENV_PLAN)  # per module / GEMM role formats
    iter_start: int = setting(0, _at_least(0))        # save iterations start..end (inclusive) every N
    iter_end: int | None = setting(None, _at_least(0, allow_none=True))
    iter_every: int = setting(1, _at_least(1))
    min_iterations: int = setting(1, _at_least(0))    # the byte budget never cuts these short
    # stop after this many saved iterations (None: the default bound)
    max_iterations: int | float | None = setting(None, _max_iterations)
    layers: tuple[int, ...] | None = setting(None, _int_list)   # 0-based transformer layer indexes
    module_regex: str | None = setting(None, _regex)  # re.search on the module path
    operations: tuple[str, ...] = setting(OPERATIONS, _one_of(OPERATIONS))
    phases: tuple[str, ...] = setting(PHASES, _one_of(PHASES))
    layer_types: tuple[str, ...] = setting(LAYER_TYPES, _one_of(LAYER_TYPES))
    tensor_names: tuple[str, ...] | None = setting(None, _names)
    ranks: tuple[int, ...] | None = setting(None, _int_list)   # global ranks that save (None: all)
    # tensor bytes per rank, then stats only (None: the default bound)
    byte_budget: int | float | None = setting(None, _size)
    max_rows: int | None = setting(None, _at_least(1, allow_none=True))  # rows kept in a file
    stats_only: bool = setting(False, _bool)          # manifest records only, no tensor files
    save_quantized: bool = setting(False, _bool)      # also save the operand the GEMM saw
    emulate_attention: bool = setting(True, _bool)    # quantize Q, K (Q·Kᵀ) and P, V (P·V)
    probs_heads: int = setting(2, _at_least(0))       # attention probabilities: heads kept (0: none)
    probs_rows: int = setting(256, _at_least(1))      # ... and query rows kept (evenly strided)
    range_formats: tuple[str, ...] = setting((), _formats)   # extra formats for overflow/underflow stats
    # per-tensor what-if numerics (quant.whatif): off unless asked for ("default" = WHATIF_FORMATS)
    # because they cost ~1 ms per format and tensor on a CPU (stats-only 2-2.8x instead of ~1.2x)
    whatif_formats: tuple[str, ...] = setting((), _whatif, ENV_WHATIF)
    # rows sampled above this
    whatif_max_elements: int | float | None = setting(WHATIF_MAX_ELEMENTS, _max_iterations)
    whatif_every: int = setting(1, _at_least(1))      # what-if on every N-th captured iteration
    # ... and only while they have used at most this share of wall time (tensor_capture.whatif
    # WhatifGate; "unlimited": every due iteration)
    whatif_budget: float = setting(WHATIF_BUDGET, _share)
    # what-if numerics to TensorBoard (None: Megatron's)
    tensorboard_dir: str | None = setting(None, _optional_dir, ENV_TENSORBOARD)
    queue_size: int = setting(64, _at_least(1))       # background writer queue (items)
    underflow_warnings: bool = setting(True, _bool)   # emulation: warn by quant.format_loss
    underflow_hold: int = setting(100, _at_least(0))  # a level's fall said once it held this many iterations
    # -- the flight recorder (mode: recorder; tensor_capture.recorder.flight, docs/capture.md) ----------
    mode: str = setting(MODE_CAPTURE, _mode, ENV_MODE)
    recorder_window: int = setting(8, _at_least(1))   # W: iterations the ring keeps (per micro-batch)
    recorder_every: int = setting(1, _at_least(1))    # N: statistics reach the host every N iterations
    recorder_summary_every: int = setting(50, _at_least(1))   # K: summary rows every K iterations
    recorder_full_iterations: int = setting(1000, _at_least(1))  # R: kept whole; older roll up
    recorder_trigger_iterations: int = setting(2, _at_least(1))  # J: captured in full after a trigger
    recorder_memory: int | float = setting(RECORDER_MEMORY, _recorder_memory)  # the ring's bound (bytes)
    recorder_stop_on_trigger: bool = setting(False, _bool)  # stop once a trigger's capture is written
    recorder_warmup: int = setting(10, _at_least(2))  # iterations before loss / grad-norm / flush judge
    recorder_sigma: float = setting(6.0, _positive_float)   # how far above its rolling baseline a spike is
    # -- the auto-guard (tensor_capture.guard; its settings: tensor_capture.guard_rules) --------
    guard: Any = setting(None, _guard, ENV_GUARD)     # GuardSettings, or None: off

    @property
    def emulating(self) -> bool:
        return not is_high_precision(self.quant_type) or bool(self.quant_plan)


# YAML may group the iteration schedule: iterations: {start, end, every}
_NESTED = {"iterations": {"start": "iter_start", "end": "iter_end", "every": "iter_every"}}


def env_requests_activity(env: Mapping[str, str] | None = None) -> bool:
    """Is capture on? The one reading of the environment for that question: TENSOR_SAVE_ENABLED
    set to anything but a false value, a CUSTOM_QUANT_TYPE that emulates, or a
    TENSOR_SAVE_CONFIG file. Cheap and lenient on purpose: a misspelled value counts as "on",
    so that load_config runs and rejects it with a clear message instead of capture staying
    silently off."""
    env = os.environ if env is None else env
    return (env.get(ENV_ENABLED, "").strip().lower() not in _FALSE
            or env.get(ENV_MODE, "").strip().lower() == MODE_RECORDER
            or not is_high_precision(env.get(ENV_QUANT))
            or bool(env.get(ENV_PLAN, "").strip())
            or env.get(ENV_GUARD, "").strip().lower() not in _FALSE
            or bool(env.get(ENV_CONFIG, "").strip()))


def _settings() -> dict[str, Any]:
    """setting name -> its field (read at each call: the fields are the one table)."""
    return {f.name: f for f in fields(CaptureConfig)}


def _validate(raw: dict[str, Any], display: Mapping[str, str] | None = None) -> CaptureConfig:
    display = display or {}
    settings = _settings()
    unknown = sorted(set(raw) - set(settings))
    if unknown:
        raise ConfigError(f"unknown capture setting(s) {unknown}; known: {sorted(set(settings) | set(_NESTED))}")
    # display name: the environment variable when the value came from one
    cfg = {key: settings[key].metadata["parse"](display.get(key, key), value)
           for key, value in raw.items()}
    if cfg.get("guard") is not None and "mode" not in raw:   # the guard turns the recorder on
        cfg["mode"] = MODE_RECORDER
    if cfg.get("mode") == MODE_RECORDER and "enabled" not in raw:
        cfg["enabled"] = True        # TENSOR_SAVE_MODE=recorder alone turns the recorder on
    out = _with_guard(_with_plan(CaptureConfig(**cfg)), display.get("guard", "guard"))
    if out.iter_end is not None and out.iter_end < out.iter_start:
        raise ConfigError(f"iterations end={out.iter_end} is before start={out.iter_start}")
    return out


def _with_plan(config: CaptureConfig) -> CaptureConfig:
    """Check the precision plan and agree it with CUSTOM_QUANT_TYPE: the plan's ``default``
    stands for CUSTOM_QUANT_TYPE when that is unset; two different names are refused (which
    one was meant cannot be guessed)."""
    if not config.quant_plan:
        return config
    plan = load_quant_plan(config.quant_plan)
    quant = None if is_high_precision(config.quant_type) else config.quant_type
    if plan.default and quant and plan.default != quant.lower():
        raise ConfigError(f"{ENV_PLAN}={config.quant_plan} has default {plan.default} but "
                          f"{ENV_QUANT}={quant}: make them agree or drop one")
    if quant is None and plan.default and plan.default != HIGH_PRECISION:
        return replace(config, quant_type=plan.default)
    return config


def _with_guard(config: CaptureConfig, name: str) -> CaptureConfig:
    """Refuse, before training, a guard that could never act on the run's format."""
    if config.guard is None:
        return config
    from .guard_rules import GuardError, check_format

    fmt = None if is_high_precision(config.quant_type) else config.quant_type
    try:
        check_format(config.guard, fmt, name)
    except GuardError as exc:
        raise ConfigError(str(exc)) from None
    return config


def load_quant_plan(path: str):
    """The precision plan at ``path`` (quant.precision_plan), ConfigError on any problem."""
    from quant.precision_plan import PlanError, load_plan

    try:
        return load_plan(path)
    except PlanError as exc:
        raise ConfigError(f"{ENV_PLAN}: {exc}") from None


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the capture config ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the capture config must be a mapping of settings, got {type(data).__name__}")
    data = dict(data.get("tensor_capture", data)) if "tensor_capture" in data else dict(data)
    for group, mapping in _NESTED.items():
        if group in data:
            sub = data.pop(group) or {}
            if not isinstance(sub, dict):
                raise ConfigError(f"{p}: '{group}' must be a mapping with keys {sorted(mapping)}")
            bad = sorted(set(sub) - set(mapping))
            if bad:
                raise ConfigError(f"{p}: unknown key(s) {bad} under '{group}'; known: {sorted(mapping)}")
            for k, v in sub.items():
                data[mapping[k]] = v
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """setting name -> raw value, for each setting whose environment variable is set."""
    return {f.name: env[f.metadata["env"]] for f in _settings().values()
            if f.metadata["env"] and f.metadata["env"] in env}


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                **overrides: Any) -> CaptureConfig:
    """Build and validate the configuration. Raises ConfigError with one clear line."""
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    path = path if path is not None else (env.get(ENV_CONFIG) or None)
    if path:
        raw.update(_read_yaml(path))
    from_env = _from_env(env)
    raw.update(from_env)
    raw.update(overrides)
    settings = _settings()
    display = {key: settings[key].metadata["env"] for key in from_env if key not in overrides}
    try:
        return _validate(raw, display)
    except ConfigError as exc:
        where = f" (config file {path})" if path else ""
        raise ConfigError(f"tensor capture: {exc}{where}") from None
