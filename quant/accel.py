"""Optional torch.compile acceleration of the quantization kernels, with an eager fallback.

Why: the eager kernels make ~15 passes over memory; Inductor fuses them into one loop. Compiling
costs seconds once per (kernel, format constants), so it only pays off on large tensors.
QUANT_COMPILE=auto (default): compile for tensors of at least QUANT_COMPILE_MIN_NUMEL elements
(default 2^21); 1: always; 0: never. Any compile failure falls back to eager for good.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

import torch

_CACHE: dict = {}
_BROKEN: list = []  # holds the first compile error; non-empty disables compilation
DEFAULT_MIN_NUMEL = 1 << 21


def _mode() -> str:
    return os.environ.get("QUANT_COMPILE", "auto").strip().lower()


def should_compile(numel: int) -> bool:
    if _BROKEN:
        return False
    mode = _mode()
    if mode in ("0", "false", "no", "off"):
        return False
    if mode in ("1", "true", "yes", "on", "always"):
        return True
    try:
        threshold = int(os.environ.get("QUANT_COMPILE_MIN_NUMEL", DEFAULT_MIN_NUMEL))
    except ValueError:
        threshold = DEFAULT_MIN_NUMEL
    return numel >= threshold


def compiled(fn: Callable, static: tuple) -> Callable:
    """The compiled version of ``fn`` with its constant arguments bound (cached)."""
    key = (fn, static)
    if key not in _CACHE:
        def bound(*tensors):
            return fn(tensors[0], *static, *tensors[1:])
        bound.__name__ = f"quant_{fn.__name__}"
        _CACHE[key] = torch.compile(bound, fullgraph=True)
    return _CACHE[key]


def run(fn: Callable, tensors: tuple, static: tuple, extra: tuple = ()) -> torch.Tensor:
    """Run ``fn(*tensors, *static, *extra)`` compiled when worthwhile, else eagerly."""
    if should_compile(tensors[0].numel()):
        try:
            return compiled(fn, static)(*tensors, *extra)
        except Exception as exc:  # compiler missing, unsupported op ...: stay correct, go eager
            _BROKEN.append(exc)
            print(f"quant: torch.compile unavailable ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}); using eager kernels",
                  file=sys.stderr)
    return fn(*tensors, *static, *extra)


def compile_error():
    """The exception that disabled compilation, or None."""
    return _BROKEN[0] if _BROKEN else None
