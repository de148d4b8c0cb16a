"""Training profiler: static AMP checker, run-time precision audit, ``@watch_training``,
``analyze_tensor``, layer-wise diff.

Imports are lazy so that ``import training_profiler`` stays cheap (no Megatron, no TensorBoard)
and the command-line tools start fast.
"""
from __future__ import annotations

from typing import Any

_LAZY = {
    "watch_training": ("training_profiler.monitor", "watch_training"),
    "AdaptiveThreshold": ("training_profiler.monitor", "AdaptiveThreshold"),
    "TrainingMonitor": ("training_profiler.monitor", "TrainingMonitor"),
    "analyze_tensor": ("training_profiler.tensor_analyzer", "analyze_tensor"),
    "check_source": ("training_profiler.amp_checker.checker", "check_source"),
    "check_paths": ("training_profiler.amp_checker.checker", "check_paths"),
    "layer_diff": ("training_profiler.layer_diff", "layer_diff"),
    "audit_precision": ("training_profiler.audit", "audit_precision"),
    "precision_audit": ("training_profiler.audit", "precision_audit"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'training_profiler' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
