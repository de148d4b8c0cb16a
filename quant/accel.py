"""Optional torch.compile acceleration of the quantization kernels, with an eager fallback.

Why: the eager kernels make ~15 passes over memory; Inductor fuses them into one loop. Compiling
costs seconds once per (kernel, format constants), so it only pays off on large tensors.
QUANT_COMPILE=auto (default): compile CPU tensors of at least QUANT_COMPILE_MIN_NUMEL elements
(default 2^21); 1: always (any device); 0: never. Any compile failure falls back to eager for
good.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import torch

_CACHE: dict = {}
_BROKEN: list = []  # holds the first compile error; non-empty disables compilation
DEFAULT_MIN_NUMEL = 1 << 21


def _mode() -> str:
    return os.environ.get("QUANT_COMPILE", "auto").strip().lower()


def should_compile(numel: int, device_type: str = "cpu") -> bool:
    """Whether to use the compiled kernel for a tensor of ``numel`` elements on a device.

    auto mode compiles on CPU only: the compiled kernels are verified against the eager ones on
    CPU; on CUDA (untested here: Inductor would emit Triton) set QUANT_COMPILE=1 to opt in.
    """
    if _BROKEN:
        return False
    mode = _mode()
    if mode in ("0", "false", "no", "off"):
        return False
    if mode in ("1", "true", "yes", "on", "always"):
        return True
    if device_type != "cpu":
        return False
    try:
        threshold = int(os.environ.get("QUANT_COMPILE_MIN_NUMEL", DEFAULT_MIN_NUMEL))
    except ValueError:
        threshold = DEFAULT_MIN_NUMEL
    return numel >= threshold


def _in_float32(fn: Callable, static: tuple) -> Callable:
    """fn applied to x in float32, result back in x's dtype (one fused pass when compiled)."""
    def bound(x, noise=None):
        args = (noise,) if noise is not None else ()
        y = fn(x.float(), *static, *args)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    bound.__name__ = f"quant_{fn.__name__}"
    return bound


def compiled(fn: Callable, static: tuple) -> Callable:
    """The compiled version of ``fn`` with its constant arguments bound (cached)."""
    key = (fn, static)
    if key not in _CACHE:
        _CACHE[key] = torch.compile(_in_float32(fn, static), fullgraph=True)
    return _CACHE[key]


def run(fn: Callable, x: torch.Tensor, static: tuple,
        noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fn(x.float(), *static[, noise]).to(x.dtype)``, compiled when worthwhile.

    Random rounding (noise given) always runs eagerly: the noise comes from the caller's
    generator, outside any compiled graph.
    """
    if noise is None and should_compile(x.numel(), x.device.type):
        try:
            return compiled(fn, static)(x)
        except Exception as exc:  # compiler missing, unsupported op ...: stay correct, go eager
            _BROKEN.append(exc)
            print(f"quant: torch.compile unavailable ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}); using eager kernels",
                  file=sys.stderr)
    return _in_float32(fn, static)(x, noise)


def compile_error():
    """The exception that disabled compilation, or None."""
    return _BROKEN[0] if _BROKEN else None
