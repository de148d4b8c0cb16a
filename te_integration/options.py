"""The YAML options of our debug features, validated when ``debug_api.initialize`` reads the file.

Why at initialize: nvdlfw-inspect only checks that a feature name exists; an option typo or an
unknown format would otherwise surface at the first forward (or never: a misspelled ``freq`` is
silently ignored). Our features' options are a table (``FEATURE_OPTIONS``: option -> checker);
formats come from quant.FORMATS, tensor names from te_integration.names. A mistake raises
:class:`InspectConfigError` (a lowp_common.UserError) naming the file, the section, the key and
the valid values, and leaves nvdlfw-inspect uninitialised.

Validation is attached to nvdlfw-inspect's config loading once (``install_validation``, called
when our feature folder is loaded); it looks only at our features' sections.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional

from lowp_common import UserError
from quant.formats import FORMATS, WHATIF_FORMATS
from quant.vocabulary import ENV_DIR, FormatNameError, check_format_name

from . import names


class InspectConfigError(UserError, ValueError):
    """A debug-API YAML mistake in one of our features' sections."""


def _formats(valid: tuple[str, ...], default: tuple[str, ...] = ()
             ) -> Callable[[str, Any], tuple[str, ...]]:
    """A list of format names from ``valid``; the word "default" stands for ``default``."""
    def check(key: str, value: Any) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items:
            raise InspectConfigError(f"{key}: expected a list of formats; valid: {', '.join(valid)}")
        out = []
        for item in items:
            name = str(item).strip().lower()
            if name == "default" and default:
                out += list(default)
                continue
            try:
                out.append(check_format_name(item, key, valid, high_precision=False))
            except FormatNameError as exc:
                raise InspectConfigError(str(exc)) from None
        return tuple(out)
    return check


def _int(minimum: int) -> Callable[[str, Any], int]:
    def check(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InspectConfigError(f"{key}: {value!r} must be an integer >= {minimum}")
        return value
    return check


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InspectConfigError(f"{key}: {value!r} must be true or false")
    return value


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InspectConfigError(f"{key}: {value!r} must be a non-empty string (a folder)")
    return value


def _intervals(key: str, value: Any) -> list:
    ok = isinstance(value, list) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) for v in p)
        for p in value)
    if not ok:
        raise InspectConfigError(f"{key}: {value!r} must be a list of [start, end] pairs")
    return value


WHATIF_FORMATS_VALID: tuple[str, ...] = tuple(n for n in FORMATS if n != "fp32")
BLOCK_FORMATS: tuple[str, ...] = tuple(n for n, s in FORMATS.items() if s.is_block)
#: the default block-scale set: the block formats of capture's default what-if set
BLOCK_DEFAULT: tuple[str, ...] = tuple(n for n in WHATIF_FORMATS if n in BLOCK_FORMATS)
#: schedule options every feature takes (nvdlfw-inspect / TE spelling)
_SCHEDULE: dict[str, Callable[[str, Any], Any]] = {
    "freq": _int(1), "start_step": _int(0), "end_step": _int(-1), "start_end_list": _intervals,
}
#: feature -> option -> checker (besides enabled / tensors / tensors_struct)
FEATURE_OPTIONS: dict[str, dict[str, Callable[[str, Any], Any]]] = {
    "LowpWhatIf": {**_SCHEDULE, "formats": _formats(WHATIF_FORMATS_VALID, WHATIF_FORMATS),
                   "max_elements": _int(1)},
    "LowpBlockScaleStats": {**_SCHEDULE, "formats": _formats(BLOCK_FORMATS, BLOCK_DEFAULT),
                            "max_elements": _int(1)},
    "LowpCapture": {**_SCHEDULE, "save_dir": _text, "stats_only": _bool,
                    "whatif_formats": _formats(WHATIF_FORMATS_VALID, WHATIF_FORMATS),
                    "max_rows": _int(1)},
}
#: defaults of options a feature reads
DEFAULTS: dict[str, Any] = {
    "freq": 1, "start_step": 0, "end_step": -1, "start_end_list": None,
    "formats:LowpWhatIf": WHATIF_FORMATS,
    "formats:LowpBlockScaleStats": BLOCK_DEFAULT,
    "stats_only": False, "whatif_formats": (), "max_rows": None, "max_elements": None,
}
_STRUCTURAL = ("enabled", "tensors", "tensors_struct")


def option(config: Mapping[str, Any], key: str, feature: str) -> Any:
    """A (validated) option of one routed tensor's config, else its default."""
    if key in config:
        return FEATURE_OPTIONS[feature][key](key, config[key])
    if key == "save_dir":
        return os.environ.get(ENV_DIR) or "./tensor_logs"
    return DEFAULTS.get(f"{key}:{feature}", DEFAULTS.get(key))


def _check_tensors(where: str, namespace: str, value: Any) -> None:
    valid = names.tensor_names(namespace)
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise InspectConfigError(f"{where}: expected a list of tensor names; valid: {', '.join(valid)}")
    for t in items:
        if t not in valid:
            raise InspectConfigError(f"{where}: unknown tensor {t!r} for namespace {namespace}; "
                                     f"valid: {', '.join(valid)}")


def _check_options(where: str, feature: str, cfg: Mapping[str, Any], namespace: str) -> None:
    table = FEATURE_OPTIONS[feature]
    for key, value in cfg.items():
        here = f"{where}.{key}"
        if key == "tensors":
            _check_tensors(here, namespace, value)
        elif key == "tensors_struct":
            if not isinstance(value, list):
                raise InspectConfigError(f"{here}: expected a list of {{tensor: ..., options}}")
            for i, item in enumerate(value):
                if not isinstance(item, dict) or "tensor" not in item:
                    raise InspectConfigError(f"{here}[{i}]: each entry needs a 'tensor' key")
                _check_tensors(f"{here}[{i}].tensor", namespace, [item["tensor"]])
                _check_options(f"{here}[{i}]", feature, {k: v for k, v in item.items()
                                                        if k != "tensor"}, namespace)
        elif key == "enabled":
            _bool(here, value)
        elif key in table:
            try:
                table[key](key, value)
            except InspectConfigError as exc:
                raise InspectConfigError(f"{where}.{exc}") from None
        else:
            valid = sorted(set(table) | set(_STRUCTURAL))
            raise InspectConfigError(f"{here}: unknown option {key!r}; valid: {', '.join(valid)}")


def validate(config: Mapping[str, Any], source: str = "config") -> None:
    """Check every enabled section's options of our features (both namespaces)."""
    for section, cfg in config.items():
        if not isinstance(cfg, Mapping) or not cfg.get("enabled"):
            continue
        for namespace in names.NAMESPACES:
            features = cfg.get(namespace)
            if not isinstance(features, Mapping):
                continue
            for feature, fcfg in features.items():
                if feature not in FEATURE_OPTIONS:
                    if namespace == names.LOWP_NAMESPACE:
                        raise InspectConfigError(
                            f"{source}: {section}.{namespace}: unknown feature {feature!r}; "
                            f"valid: {', '.join(FEATURE_OPTIONS)}")
                    continue                     # one of TE's own features: TE checks it
                if not isinstance(fcfg, Mapping):
                    raise InspectConfigError(f"{source}: {section}.{namespace}.{feature}: "
                                             "expected a mapping of options")
                _check_options(f"{source}: {section}.{namespace}.{feature}", feature, fcfg,
                               namespace)


def _raw(config_input: Any) -> Optional[Mapping[str, Any]]:
    if isinstance(config_input, Mapping):
        return config_input
    if isinstance(config_input, (str, os.PathLike)) and os.path.isfile(config_input):
        import yaml

        with open(config_input, encoding="utf-8") as fh:
            return yaml.safe_load(fh) or {}
    return None


def install_validation() -> None:
    """Validate our features' options whenever nvdlfw-inspect loads a config (idempotent)."""
    from nvdlfw_inspect.config_manager import ConfigManager

    current = ConfigManager.__dict__["_load_config"].__func__
    if getattr(current, "_lowp_validates", False):
        return

    def _load_config(cls, config_input, registry_data):
        current(cls, config_input, registry_data)
        raw = _raw(config_input)
        if raw is None:
            return
        source = os.fspath(config_input) if not isinstance(config_input, Mapping) else "config"
        try:
            validate(raw, source)
        except InspectConfigError:
            import nvdlfw_inspect.api as debug_api

            debug_api.end_debug()   # leave nvdlfw-inspect uninitialised, not half-configured
            raise

    _load_config._lowp_validates = True
    ConfigManager._load_config = classmethod(_load_config)
