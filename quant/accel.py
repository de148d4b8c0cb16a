"""Optional torch.compile acceleration of the torch kernels, compiled in the background.

Why: the eager kernels make ~15 passes over memory; Inductor fuses them into one loop, which on
a CPU makes CUSTOM_QUANT_TYPE emulation of a small model several times cheaper. But a cold
compile costs seconds to tens of seconds per kernel, so no caller ever waits for one:

- QUANT_COMPILE=auto (default): CPU tensors of at least QUANT_COMPILE_MIN_NUMEL elements
  (default 2^14) are quantized eagerly; once a kernel is hot (QUANT_COMPILE_AFTER calls,
  default 8: a training loop, not a one-off command) ONE background thread compiles it (dynamic
  shapes: one compile serves every shape of that dtype); the compiled kernel is checked bit for
  bit against the eager one on the tensor that asked for it, then takes over. At exit a compile
  under way is finished first (a process torn down mid-compile can abort).
- QUANT_COMPILE=1: compile synchronously on first use, any device (tests, benchmarks).
- QUANT_COMPILE=0: never compile.

Any compile failure or mismatch disables compilation for good (one line on stderr); results
never change, only their speed. CUDA tensors use the Triton backend (quant.backends) instead.
"""
from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import types
from typing import Callable, Optional

import torch

_CACHE: dict = {}      # key -> compiled callable, verified
_QUEUED: set = set()   # keys handed to the background compiler
_BROKEN: list = []     # holds the first compile error; non-empty disables compilation
_JOBS: "queue.Queue" = queue.Queue()
_WORKER: list = []
_CALLS: dict = {}      # key -> eager calls so far (a kernel is compiled once it is hot)
DEFAULT_MIN_NUMEL = 1 << 14
DEFAULT_HOT_AFTER = 8


def _mode() -> str:
    mode = os.environ.get("QUANT_COMPILE", "auto").strip().lower()
    if mode in ("0", "false", "no", "off", "never"):
        return "off"
    if mode in ("1", "true", "yes", "on", "always", "sync"):
        return "sync"
    return "auto"


def should_compile(numel: int, device_type: str = "cpu") -> bool:
    """Whether a tensor of ``numel`` elements on a device may use a compiled kernel.

    auto mode: CPU only (the compiled kernels are verified against the eager ones on CPU; CUDA
    tensors go to the Triton kernels), from QUANT_COMPILE_MIN_NUMEL elements up.
    """
    if _BROKEN:
        return False
    mode = _mode()
    if mode == "off":
        return False
    if mode == "sync":
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
    # a code object of its own per kernel and constants: torch.compile caches (and counts
    # recompilations) per code object, so kernels must not share one
    name = f"quant_{fn.__name__}_{abs(hash(static)) % 10 ** 8}"
    code = bound.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, bound.__globals__, name, bound.__defaults__,
                              bound.__closure__)


def compiled(fn: Callable, static: tuple) -> Callable:
    """A compiled version of ``fn`` with its constant arguments bound (dynamic shapes)."""
    return torch.compile(_in_float32(fn, static), fullgraph=True, dynamic=True)


def _disable(exc: BaseException) -> None:
    if not _BROKEN:
        _BROKEN.append(exc)
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"quant: torch.compile unavailable ({type(exc).__name__}: {first}); using eager "
              "kernels", file=sys.stderr)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(nan_a, nan_b)
                and torch.equal(a[~nan_a].view(ints), b[~nan_b].view(ints)))


class _Unguarded:
    """The global state every compiled call runs under, in the compiling thread and in the
    caller's: no autograd, no CPU autocast. torch.compile guards on that state, and a guard
    that failed in the caller's thread would recompile there."""

    def __enter__(self):
        self._autocast = torch.autocast("cpu", enabled=False)
        self._autocast.__enter__()
        self._grad = torch.no_grad()
        self._grad.__enter__()

    def __exit__(self, *exc):
        self._grad.__exit__(*exc)
        self._autocast.__exit__(*exc)
        return False


def _canonical(x: torch.Tensor, keep_dims: int) -> torch.Tensor:
    """The shape every kernel is compiled for: x flattened but for its last ``keep_dims``
    dimensions (0: elementwise and per-tensor kernels; 1: [-1, block]; 2: [-1, block, inner]).
    No such reshape changes a result, and one compiled graph then serves every shape."""
    return x.reshape(-1, *x.shape[x.dim() - keep_dims:]) if keep_dims else x.reshape(-1)


def _build(key, fn: Callable, static: tuple, sample: torch.Tensor) -> None:
    """Compile one kernel, check it bit for bit on ``sample`` (canonical shape), publish it."""
    try:
        kernel = compiled(fn, static)
        with _Unguarded():
            got = kernel(sample)
        if not _same_bits(got, _in_float32(fn, static)(sample)):
            raise RuntimeError(f"compiled {fn.__name__} differs from the eager kernel")
        _CACHE[key] = kernel
    except Exception as exc:  # compiler missing, unsupported op, mismatch: stay eager
        _disable(exc)


def _worker() -> None:
    while True:
        job = _JOBS.get()
        if job is None:                     # shutdown
            _JOBS.task_done()
            return
        key, fn, static, sample = job
        if not _BROKEN:
            _build(key, fn, static, sample)
        _JOBS.task_done()


def _shutdown() -> None:
    """At exit: drop queued jobs and let a compile under way finish (a process that exits in
    the middle of an Inductor compile can abort in C++ teardown)."""
    if not _WORKER:
        return
    while True:
        try:
            _JOBS.get_nowait()
            _JOBS.task_done()
        except queue.Empty:
            break
    _JOBS.put(None)
    _WORKER[0].join(timeout=1)
    if _WORKER[0].is_alive():
        print("quant: finishing a background kernel compile before exit "
              "(QUANT_COMPILE=0 turns compiling off)", file=sys.stderr, flush=True)
        _WORKER[0].join()


def _hot_after() -> int:
    try:
        return max(int(os.environ.get("QUANT_COMPILE_AFTER", DEFAULT_HOT_AFTER)), 1)
    except ValueError:
        return DEFAULT_HOT_AFTER


def _enqueue(key, fn: Callable, static: tuple, x: torch.Tensor) -> None:
    """Count a call of an uncompiled kernel; queue its compile once it is hot."""
    if key in _QUEUED:
        return
    _CALLS[key] = _CALLS.get(key, 0) + 1
    if _CALLS[key] < _hot_after():
        return
    _QUEUED.add(key)
    if not _WORKER:
        thread = threading.Thread(target=_worker, name="quant-compile", daemon=True)
        thread.start()
        _WORKER.append(thread)
        atexit.register(_shutdown)
    _JOBS.put((key, fn, static, x.detach().clone()))


def wait_for_background(timeout: Optional[float] = None) -> bool:
    """Block until the queued background compiles are done (tests, benchmarks); True when
    the queue is empty."""
    done = threading.Event()

    def waiter():
        _JOBS.join()
        done.set()
    threading.Thread(target=waiter, daemon=True).start()
    return done.wait(timeout)


def run(fn: Callable, x: torch.Tensor, static: tuple,
        noise: Optional[torch.Tensor] = None, keep_dims: int = 0) -> torch.Tensor:
    """``fn(x.float(), *static[, noise]).to(x.dtype)``, compiled when worthwhile.

    ``keep_dims``: how many trailing dimensions fn's result depends on the layout of (0:
    elementwise or per whole tensor; 1: blocks along the last dimension; 2: blocks along the
    second last, [..., block, inner]). Random rounding (noise given) always runs eagerly: the
    noise comes from the caller's generator, outside any compiled graph.
    """
    if noise is None and should_compile(x.numel(), x.device.type):
        flat = _canonical(x, keep_dims)
        if min(flat.shape) < 2:          # a size-1 dimension would need a graph of its own
            return _in_float32(fn, static)(x, noise)
        key = (fn, static, x.dtype, keep_dims, flat.shape[flat.dim() - keep_dims]
               if keep_dims else 0, x.device.type)
        kernel = _CACHE.get(key)
        if kernel is None and _mode() == "sync":
            _build(key, fn, static, flat)
            kernel = _CACHE.get(key)
        elif kernel is None:
            _enqueue(key, fn, static, flat)
        if kernel is not None:
            try:
                with _Unguarded():
                    return kernel(flat).reshape(x.shape)
            except Exception as exc:  # a guard failed to recompile, ...: stay correct
                _disable(exc)
    return _in_float32(fn, static)(x, noise)


def compile_error():
    """The exception that disabled compilation, or None."""
    return _BROKEN[0] if _BROKEN else None
