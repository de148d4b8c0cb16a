"""Optional torch.compile acceleration of the torch kernels, compiled in the background.

Why: the eager kernels make ~15 passes over memory; Inductor fuses them into one loop, which on
a CPU makes CUSTOM_QUANT_TYPE emulation of a small model several times cheaper. But a cold
compile costs seconds to tens of seconds per kernel, so no caller ever waits for one:

- QUANT_COMPILE=auto (default): CPU tensors of at least QUANT_COMPILE_MIN_NUMEL elements
  (default 2^14) are quantized eagerly; once a kernel is hot (QUANT_COMPILE_AFTER calls,
  default 8: a training loop, not a one-off command) ONE background thread compiles it (dynamic
  shapes: one compile serves every shape of that dtype); the compiled kernel is checked bit for
  bit against the eager one on the tensor that asked for it, then takes over. At exit the
  queued compiles are dropped and one under way is cut short, quietly (it would only fail on
  the interpreter's shutdown: Inductor can no longer start its compile pool); the exit waits
  for that thread to leave torch (a process torn down mid-compile can abort).
- QUANT_COMPILE=1: compile synchronously on first use, any device (tests, benchmarks).
- QUANT_COMPILE=0: never compile.

Any real compile failure or mismatch disables compilation for good: one line on stderr names
the kernel and the root error, and points to a file with the whole traceback; results never
change, only their speed. CUDA tensors use the Triton backend (quant.backends) instead.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import queue
import sys
import tempfile
import threading
import traceback
import types
from typing import Callable, Optional

import torch

from . import inductor_vec
from .vocabulary import ENV_COMPILE, FALSE_WORDS, TRUE_WORDS

DEFAULT_MIN_NUMEL = 1 << 14
DEFAULT_HOT_AFTER = 8


class CompileState:
    """Everything this module keeps per process, in one object (``COMPILE``): the verified
    kernels, the background compiler and the error that ended compiling. Kernels outlive any
    caller (a compile costs seconds); a test that needs a fresh start swaps a field
    (``monkeypatch.setattr(COMPILE, "kernels", {})``)."""

    def __init__(self) -> None:
        self.kernels: dict = {}     # key -> compiled callable, verified
        self.queued: set = set()    # keys handed to the background compiler
        self.calls: dict = {}       # key -> eager calls so far (a kernel is compiled once hot)
        self.broken: Optional[BaseException] = None   # the first compile error: compile no more
        self.jobs: "queue.Queue" = queue.Queue()
        self.worker: Optional[threading.Thread] = None
        self.exiting = threading.Event()   # the interpreter is shutting down: compiles dropped


COMPILE = CompileState()


def _mode() -> str:
    mode = os.environ.get(ENV_COMPILE, "auto").strip().lower()
    if mode in (*FALSE_WORDS, "never"):
        return "off"
    if mode in (*TRUE_WORDS, "always", "sync"):
        return "sync"
    return "auto"


def should_compile(numel: int, device_type: str = "cpu") -> bool:
    """Whether a tensor of ``numel`` elements on a device may use a compiled kernel.

    auto mode: CPU only (the compiled kernels are verified against the eager ones on CPU; CUDA
    tensors go to the Triton kernels), from QUANT_COMPILE_MIN_NUMEL elements up.
    """
    return COMPILE.broken is None and compile_wanted(numel, device_type)


def compile_wanted(numel: int, device_type: str = "cpu") -> bool:
    """:func:`should_compile` but for an earlier compile failure: whether compiled kernels
    are wanted for such a tensor (also what the C block kernels of quant.cpu_blocks follow)."""
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
    """A compiled version of ``fn`` with its constant arguments bound: the constants and the
    block length are specialized (Inductor folds them and unrolls the block loop; the key of a
    kernel holds them), the dimensions :func:`_build` marks are dynamic."""
    return torch.compile(_in_float32(fn, static), fullgraph=True, dynamic=None)


class _Cancelled(Exception):
    """Raised in the compile thread at interpreter exit to cut its compile short."""


def _exiting() -> bool:
    """Whether the interpreter is shutting down (its main thread has returned)."""
    return (COMPILE.exiting.is_set() or sys.is_finalizing() or not threading.main_thread().is_alive()
            or bool(getattr(threading, "_SHUTTING_DOWN", False)))


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost error: Dynamo wraps the backend's own (BackendCompilerFailed's first line
    is only "backend='inductor' raised:")."""
    seen = {id(exc)}
    while True:
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def _write_details(exc: BaseException) -> str | None:
    """The whole traceback in a file of its own (the path, or None when nothing could be
    written); a temporary name, then a rename (quant imports no other package of ours)."""
    path = os.path.join(tempfile.gettempdir(), f"quant_compile_error_{os.getpid()}.txt")
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("".join(traceback.format_exception(exc)))
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def _disable(exc: BaseException, what: str = "a kernel") -> None:
    """Compile no more; say so once, with what failed and where the details are."""
    if COMPILE.broken is not None:
        return
    COMPILE.broken = exc
    root = _root_cause(exc)
    first = str(root).strip().splitlines()[0][:200] if str(root).strip() else ""
    details = _write_details(exc)
    where = f"traceback in {details}" if details else "set TORCHDYNAMO_VERBOSE=1 for the traceback"
    print(f"quant: torch.compile of {what} failed ({type(root).__name__}: {first}); quantizing "
          f"with the eager kernels from now on (same results, slower); {where}; "
          "QUANT_COMPILE=0 turns compiling off", file=sys.stderr, flush=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b hold the same bits (NaN where the other has NaN, any payload)."""
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


def _varying_dims(sample: torch.Tensor) -> tuple:
    """The dimensions of a canonical shape that vary between calls: the rows, and the inner
    length of [-1, block, inner] (one compiled graph serves them all; the block is fixed)."""
    return (0,) if sample.dim() < 3 else (0, 2)


def _compile_context():
    """Inductor's settings while a kernel compiles: the vector bit cast (quant.inductor_vec)
    and its tag in the cache key."""
    if not inductor_vec.install():
        return contextlib.nullcontext()
    tag = torch.compiler.config.cache_key_tag
    return torch.compiler.config.patch(cache_key_tag=f"{tag}:{inductor_vec.CACHE_TAG}")


def _build(key, fn: Callable, static: tuple, sample: torch.Tensor) -> None:
    """Compile one kernel, check it bit for bit on ``sample`` (canonical shape), publish it."""
    try:
        kernel = compiled(fn, static)
        for dim in _varying_dims(sample):
            torch._dynamo.maybe_mark_dynamic(sample, dim)
        with _Unguarded(), _compile_context():
            got = kernel(sample)
        if not same_bits(got, _in_float32(fn, static)(sample)):
            raise RuntimeError(f"compiled {fn.__name__} differs from the eager kernel")
        COMPILE.kernels[key] = kernel
    except Exception as exc:  # compiler missing, unsupported op, mismatch: stay eager
        if not _exiting():    # a compile cut short by the exit is no failure: drop it
            _disable(exc, f"the {fn.__name__} kernel")


def _worker() -> None:
    try:
        while True:
            job = COMPILE.jobs.get()
            if job is None:                     # shutdown
                COMPILE.jobs.task_done()
                return
            key, fn, static, sample = job
            if COMPILE.broken is None and not COMPILE.exiting.is_set():
                _build(key, fn, static, sample)
            COMPILE.jobs.task_done()
    except _Cancelled:                          # arrived between two jobs
        return


def _drain() -> None:
    while True:
        try:
            COMPILE.jobs.get_nowait()
            COMPILE.jobs.task_done()
        except queue.Empty:
            return


def _shutdown() -> None:
    """At exit (first thing in the interpreter's shutdown): drop the queued compiles, cut the
    one under way short, and wait until its thread has left torch (a process torn down in the
    middle of an Inductor compile can abort in C++ teardown). Quiet: nothing failed."""
    COMPILE.exiting.set()
    thread = COMPILE.worker
    if thread is None or not thread.is_alive():
        return
    _drain()
    COMPILE.jobs.put(None)
    if thread.ident is not None:   # an exception raised in that thread at its next bytecode
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                   ctypes.py_object(_Cancelled))
    thread.join()


def _on_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` when the main thread has finished, before threading's other exit hooks
    registered earlier (concurrent.futures': after them Inductor cannot compile) and before
    atexit; atexit where this Python has no such hook."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError
        register(hook)
    except RuntimeError:
        atexit.register(hook)


def hot_after() -> int:
    """How many eager calls make a kernel hot (auto mode: QUANT_COMPILE_AFTER, default 8)."""
    try:
        return max(int(os.environ.get("QUANT_COMPILE_AFTER", DEFAULT_HOT_AFTER)), 1)
    except ValueError:
        return DEFAULT_HOT_AFTER


def _enqueue(key, fn: Callable, static: tuple, x: torch.Tensor) -> None:
    """Count a call of an uncompiled kernel; queue its compile once it is hot."""
    if key in COMPILE.queued:
        return
    COMPILE.calls[key] = COMPILE.calls.get(key, 0) + 1
    if COMPILE.calls[key] < hot_after():
        return
    COMPILE.queued.add(key)
    if COMPILE.worker is None:
        thread = threading.Thread(target=_worker, name="quant-compile", daemon=True)
        COMPILE.worker = thread
        _on_exit(_shutdown)
        thread.start()
    COMPILE.jobs.put((key, fn, static, x.detach().clone()))


def wait_for_background(timeout: Optional[float] = None) -> bool:
    """Block until the queued background compiles are done (tests, benchmarks); True when
    the queue is empty."""
    done = threading.Event()

    def waiter():
        COMPILE.jobs.join()
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
        kernel = COMPILE.kernels.get(key)
        if kernel is None and _mode() == "sync":
            _build(key, fn, static, flat)
            kernel = COMPILE.kernels.get(key)
        elif kernel is None:
            _enqueue(key, fn, static, flat)
        if kernel is not None:
            try:
                with _Unguarded():
                    return kernel(flat).reshape(x.shape)
            except Exception as exc:  # a guard failed to recompile, ...: stay correct
                _disable(exc, "a compiled kernel's call")
    return _in_float32(fn, static)(x, noise)


def compile_error():
    """The exception that disabled compilation, or None."""
    return COMPILE.broken
