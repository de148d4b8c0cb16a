"""Capture configuration: environment variables plus an optional YAML file, validated once.

Why validate up front: a typo in a 10-hour run's capture settings should fail in the first
second with one line naming the setting and the fix, not silently capture nothing.

Precedence: defaults < YAML file < environment variables < explicit keyword overrides.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from quant.formats import WHATIF_FORMATS

ENV_ENABLED = "TENSOR_SAVE_ENABLED"
ENV_DIR = "TENSOR_SAVE_DIR"
ENV_ITERATION = "TENSOR_SAVER_ITERATION"
ENV_QUANT = "CUSTOM_QUANT_TYPE"
ENV_PLAN = "CUSTOM_QUANT_PLAN"              # a precision plan file (quant.precision_plan)
ENV_CONFIG = "TENSOR_SAVE_CONFIG"
ENV_WHATIF = "TENSOR_SAVE_WHATIF_FORMATS"   # comma-separated what-if formats; "none": off
ENV_TENSORBOARD = "TENSOR_SAVE_TENSORBOARD_DIR"   # what-if numerics as TensorBoard events here
ENV_MODE = "TENSOR_SAVE_MODE"               # capture (default) | recorder (the flight recorder)
ENV_GUARD = "TENSOR_SAVE_GUARD"             # on: the auto-guard (and the recorder with it)

# Values of CUSTOM_QUANT_TYPE that mean "no emulation" (the label still goes into file names).
NO_QUANT = ("fp32", "none", "")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_OPERATIONS = ("forward", "backward")
_PHASES = ("pre", "post")
_LAYER_TYPES = ("attention", "linear")
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


@dataclass(frozen=True)
class CaptureConfig:
    """Every capture setting. YAML keys are these field names."""

    enabled: bool = False                     # TENSOR_SAVE_ENABLED
    save_dir: str = "./tensor_logs"           # TENSOR_SAVE_DIR
    iteration: int = 0                        # TENSOR_SAVER_ITERATION: the starting iteration
    quant_type: str | None = None             # CUSTOM_QUANT_TYPE (None: no emulation)
    quant_plan: str | None = None             # CUSTOM_QUANT_PLAN: per module / GEMM role formats
    iter_start: int = 0                       # save iterations start..end (inclusive) every N
    iter_end: int | None = None
    iter_every: int = 1
    min_iterations: int = 1                   # the byte budget never cuts these short
    max_iterations: int | float | None = None  # stop after this many saved iterations (None: default)
    layers: tuple[int, ...] | None = None     # 0-based transformer layer indexes
    module_regex: str | None = None           # re.search on the module path
    operations: tuple[str, ...] = _OPERATIONS
    phases: tuple[str, ...] = _PHASES
    layer_types: tuple[str, ...] = _LAYER_TYPES
    tensor_names: tuple[str, ...] | None = None
    ranks: tuple[int, ...] | None = None      # global ranks that save (None: all)
    byte_budget: int | float | None = None    # tensor bytes per rank, then stats only (None: default)
    max_rows: int | None = None               # keep at most this many rows in a file
    stats_only: bool = False                  # manifest records only, no tensor files
    save_quantized: bool = False              # also save the operand the GEMM saw
    emulate_attention: bool = True            # quantize Q, K (Q·Kᵀ) and P, V (P·V)
    probs_heads: int = 2                      # attention probabilities: heads kept (0: none)
    probs_rows: int = 256                     # ... and query rows kept (evenly strided)
    range_formats: tuple[str, ...] = ()       # extra formats for overflow/underflow stats
    # per-tensor what-if numerics (quant.whatif): off unless asked for ("default" = WHATIF_FORMATS)
    # because they cost ~1 ms per format and tensor on a CPU (stats-only 2-2.8x instead of ~1.2x)
    whatif_formats: tuple[str, ...] = ()
    whatif_max_elements: int | float | None = WHATIF_MAX_ELEMENTS  # rows sampled above this
    whatif_every: int = 1                     # what-if on every N-th captured iteration
    # ... and only while they have used at most this share of wall time (tensor_capture.whatif
    # WhatifGate; "unlimited": every due iteration)
    whatif_budget: float = WHATIF_BUDGET
    tensorboard_dir: str | None = None        # what-if numerics to TensorBoard (None: Megatron's)
    queue_size: int = 64                      # background writer queue (items)
    underflow_warnings: bool = True           # emulation: warn by quant.format_loss
    underflow_hold: int = 100                 # ... a level's fall said once it held this many iterations
    # -- the flight recorder (mode: recorder; tensor_capture.recorder.flight, docs/capture.md) ----------
    mode: str = MODE_CAPTURE                  # TENSOR_SAVE_MODE
    recorder_window: int = 8                  # W: iterations the ring keeps (per micro-batch)
    recorder_every: int = 1                   # N: statistics reach the host every N iterations
    recorder_summary_every: int = 50          # K: summary rows written every K iterations
    recorder_full_iterations: int = 1000      # R: recent iterations kept whole; older roll up
    recorder_trigger_iterations: int = 2      # J: iterations captured in full after a trigger
    recorder_memory: int | float = RECORDER_MEMORY   # bound on the ring's memory (bytes)
    recorder_stop_on_trigger: bool = False    # stop the run once a trigger's capture is written
    recorder_warmup: int = 10                 # iterations before loss / grad-norm / flush rules judge
    recorder_sigma: float = 6.0               # how far above its rolling baseline a spike is
    # -- the auto-guard (tensor_capture.guard; its settings: tensor_capture.guard_rules) --------
    guard: Any = None                         # GuardSettings, or None: off (TENSOR_SAVE_GUARD)

    @property
    def emulating(self) -> bool:
        return (self.quant_type is not None and self.quant_type not in NO_QUANT) or bool(
            self.quant_plan)


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
            or env.get(ENV_QUANT, "").strip().lower() not in NO_QUANT
            or bool(env.get(ENV_PLAN, "").strip())
            or env.get(ENV_GUARD, "").strip().lower() not in _FALSE
            or bool(env.get(ENV_CONFIG, "").strip()))


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
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


def valid_format_names() -> list[str]:
    """The formats (range statistics and what-if numerics take formats, not recipes)."""
    import quant

    return sorted(quant.FORMATS)


def _quant(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    if text.lower() in NO_QUANT:
        return text.lower() or None
    try:
        names = valid_quant_names()
    except ImportError as exc:
        raise ConfigError(f"{ENV_QUANT}={text!r} needs the quant package, which failed to import: {exc}") from None
    if text not in names:
        raise ConfigError(f"{ENV_QUANT}={text!r} is not a known format or recipe; valid names: "
                          + ", ".join([n for n in names if n != "fp32"] + ["fp32 (no quantization)"]))
    return text


def _check_formats(names: Any) -> tuple[str, ...]:
    items = (names,) if isinstance(names, str) else tuple(names or ())
    if not items:
        return ()
    known = valid_format_names()
    bad = [n for n in items if n not in known]
    if bad:
        raise ConfigError(f"range_formats={bad!r}: unknown format; valid names: {', '.join(known)}")
    return items


def _whatif(name: str, value: Any) -> tuple[str, ...]:
    """What-if formats: a list, or a comma-separated string; "none" / empty turns them off,
    "default" is quant.formats.WHATIF_FORMATS."""
    if isinstance(value, str):
        word = value.strip().lower()
        value = () if word in ("", "none", "off") else (
            WHATIF_FORMATS if word == "default" else value.split(","))
    items = tuple(str(v).strip() for v in (value or ()) if str(v).strip())
    known = valid_format_names()
    bad = [n for n in items if n not in known]
    if bad:
        raise ConfigError(f"{name}={bad!r}: unknown what-if format; valid names: "
                          f"{', '.join(known)} (or none, or default)")
    return tuple(dict.fromkeys(items))


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


# setting -> parser(display name, raw value); one row per setting.
_PARSERS: dict[str, Any] = {
    "enabled": _bool, "stats_only": _bool, "save_quantized": _bool, "emulate_attention": _bool,
    "underflow_warnings": _bool,
    "underflow_hold": lambda k, v: _int(k, v, minimum=0),
    "save_dir": _dir,
    "tensorboard_dir": lambda k, v: None if v is None or not str(v).strip() else _dir(k, v),
    "iteration": lambda k, v: _int(k, v, minimum=0),
    "iter_start": lambda k, v: _int(k, v, minimum=0),
    "iter_end": lambda k, v: _int(k, v, minimum=0, allow_none=True),
    "iter_every": lambda k, v: _int(k, v, minimum=1),
    "min_iterations": lambda k, v: _int(k, v, minimum=0),
    "max_iterations": _max_iterations,
    "max_rows": lambda k, v: _int(k, v, minimum=1, allow_none=True),
    "queue_size": lambda k, v: _int(k, v, minimum=1),
    "probs_heads": lambda k, v: _int(k, v, minimum=0),
    "probs_rows": lambda k, v: _int(k, v, minimum=1),
    "quant_type": lambda k, v: _quant(v),
    "quant_plan": lambda k, v: str(v).strip() or None if v is not None else None,
    "layers": _int_list, "ranks": _int_list,
    "module_regex": _regex,
    "operations": lambda k, v: _choices(k, v, _OPERATIONS),
    "phases": lambda k, v: _choices(k, v, _PHASES),
    "layer_types": lambda k, v: _choices(k, v, _LAYER_TYPES),
    "tensor_names": _names,
    "byte_budget": _size,
    "range_formats": lambda k, v: _check_formats(v),
    "whatif_formats": _whatif,
    "whatif_max_elements": _max_iterations,
    "whatif_every": lambda k, v: _int(k, v, minimum=1),
    "whatif_budget": lambda k, v: _share(k, v),
    "mode": _mode,
    "recorder_window": lambda k, v: _int(k, v, minimum=1),
    "recorder_every": lambda k, v: _int(k, v, minimum=1),
    "recorder_summary_every": lambda k, v: _int(k, v, minimum=1),
    "recorder_full_iterations": lambda k, v: _int(k, v, minimum=1),
    "recorder_trigger_iterations": lambda k, v: _int(k, v, minimum=1),
    "recorder_memory": lambda k, v: RECORDER_MEMORY if v is None else _size(k, v),
    "recorder_stop_on_trigger": _bool,
    "recorder_warmup": lambda k, v: _int(k, v, minimum=2),
    "recorder_sigma": _positive_float,
    "guard": lambda k, v: _guard(k, v),
}


def _guard(name: str, value: Any):
    from .guard_rules import GuardError, parse_guard

    try:
        return parse_guard(name, value)
    except GuardError as exc:
        raise ConfigError(str(exc)) from None


def _validate(raw: dict[str, Any], display: Mapping[str, str] | None = None) -> CaptureConfig:
    display = display or {}
    unknown = sorted(set(raw) - set(_PARSERS))
    if unknown:
        raise ConfigError(f"unknown capture setting(s) {unknown}; known: {sorted(set(_PARSERS) | set(_NESTED))}")
    # display name: the environment variable when the value came from one
    cfg = {key: _PARSERS[key](display.get(key, key), value) for key, value in raw.items()}
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
    quant = config.quant_type if config.quant_type not in NO_QUANT else None
    if plan.default and quant and plan.default != quant.lower():
        raise ConfigError(f"{ENV_PLAN}={config.quant_plan} has default {plan.default} but "
                          f"{ENV_QUANT}={quant}: make them agree or drop one")
    if quant is None and plan.default and plan.default != "hp":
        return replace(config, quant_type=plan.default)
    return config


def _with_guard(config: CaptureConfig, name: str) -> CaptureConfig:
    """Refuse, before training, a guard that could never act on the run's format."""
    if config.guard is None:
        return config
    from .guard_rules import GuardError, check_format

    fmt = config.quant_type if config.quant_type not in NO_QUANT else None
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


_ENV_KEYS = ((ENV_ENABLED, "enabled"), (ENV_DIR, "save_dir"), (ENV_ITERATION, "iteration"),
             (ENV_QUANT, "quant_type"), (ENV_PLAN, "quant_plan"), (ENV_WHATIF, "whatif_formats"),
             (ENV_TENSORBOARD, "tensorboard_dir"), (ENV_MODE, "mode"), (ENV_GUARD, "guard"))


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for var, key in _ENV_KEYS:
        if var in env:
            out[key] = env[var]
    return out


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
    display = {key: var for var, key in _ENV_KEYS if key in from_env and key not in overrides}
    try:
        return _validate(raw, display)
    except ConfigError as exc:
        where = f" (config file {path})" if path else ""
        raise ConfigError(f"tensor capture: {exc}{where}") from None
