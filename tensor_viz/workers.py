"""Worker processes of the report: started clean, every wait bounded, none outlives the command.

Why not fork this process: a child forked after the parent ran a parallel torch op (OpenMP's
pool) or opened DuckDB (its threads) inherits their locks but not their threads, and its
first parallel op waits forever. Workers therefore come from multiprocessing's forkserver: a
process that imported torch and the plotting modules but never ran a torch op, so each worker
is a cheap fork of a clean process (the imports are paid once, in the background; ``warm_up``).

Each worker runs one task at a time. A task that runs longer than ``timeout`` seconds has its
worker killed and comes back as :class:`Failed` (the pool goes on with a fresh worker), as
does a task whose worker died. Ctrl-C and SIGTERM in the parent kill every worker before they
propagate; a worker whose parent vanished (SIGKILL) exits by itself within a second.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable, Iterable, Iterator, Sequence

START_METHOD = "forkserver"
#: imported once by the forkserver, so every worker starts with them loaded
PRELOAD = ("tensor_viz.pipeline",)
GRACE_S = 2.0          # between SIGTERM and SIGKILL when stopping a worker
WATCH_S = 1.0          # how often a worker checks that its parent is alive
DEFAULT_TIMEOUT_S = 300.0   # seconds a worker may spend on one task (one file, one section)
READY = "ready"        # a worker's first message: started and initialized


class WorkersUnavailable(RuntimeError):
    """No worker could start here (the caller runs its tasks in this process instead)."""


@dataclass
class Failed:
    """A task that gave no result: its worker ran past the timeout (killed) or died."""

    reason: str


def context():
    """The start method's context; the forkserver preloads the report's modules."""
    ctx = mp.get_context(START_METHOD)
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def warm_up() -> None:
    """Start the forkserver now (it imports PRELOAD while this process catalogs the capture)."""
    from multiprocessing import forkserver

    with contextlib.suppress(Exception):      # no forkserver here: the pool will say so
        context()
        forkserver.ensure_running()


def _watch_parent(parent: int, ppid: int) -> None:
    """Exit when the parent is gone (killed without a chance to stop us)."""
    while True:
        time.sleep(WATCH_S)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:
            pass
        if os.getppid() != ppid:          # our forkserver exited: the parent has ended
            os._exit(1)


def _worker_main(conn, parent: int, threads: int, initializer: Callable | None,
                 initargs: tuple) -> None:
    """One worker: threads set before any torch work, then tasks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C is the parent's to handle
    import torch

    torch.set_num_threads(threads)
    threading.Thread(target=_watch_parent, args=(parent, os.getppid()), daemon=True).start()
    if initializer is not None:
        initializer(*initargs)
    conn.send(READY)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):           # the parent closed our pipe
            return
        if msg is None:
            return
        index, fn, task = msg
        try:
            reply = (index, True, fn(task))
        except Exception as exc:              # the caller's function decides what is fatal
            reply = (index, False, f"{type(exc).__name__}: {str(exc)[:200]}")
        conn.send(reply)


@contextlib.contextmanager
def _main_not_rerun():
    """While a worker starts: hide where ``__main__`` came from, so the worker does not run
    the caller's script again (multiprocessing re-imports it in every new process, and a
    script or notebook without an ``if __name__ == "__main__"`` guard would start over
    there). Tasks and initializers must therefore live in importable modules."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in vars(main)} \
        if main is not None else {}
    try:
        for k in saved:
            if k == "__spec__":
                main.__spec__ = None
            else:
                del main.__dict__[k]
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


class _Worker:
    def __init__(self, ctx, args: tuple):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, *args), daemon=True,
                                name="tensor_viz-worker")
        with _main_not_rerun():
            self.proc.start()
        child.close()
        self.task: int | None = None
        self.started = 0.0
        self.ready = False

    def give(self, index: int, fn: Callable, task: Any) -> None:
        self.task, self.started = index, time.monotonic()
        self.conn.send((index, fn, task))

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after GRACE_S; reaped either way."""
        with contextlib.suppress(OSError):
            self.conn.close()
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(GRACE_S)
            if self.proc.is_alive():
                self.proc.kill()
        self.proc.join(GRACE_S)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _sigterm_unwinds():
    """SIGTERM raises SystemExit for the duration (so the pool's cleanup runs), unless the
    program installed its own handler; main thread only."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def default_threads(workers: int) -> int:
    """Torch threads per worker: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


class Pool:
    """``workers`` processes running ``fn(task)``; see the module docstring."""

    def __init__(self, workers: int, initializer: Callable | None = None, initargs: tuple = (),
                 threads: int | None = None):
        self.size = max(1, workers)
        try:
            self.ctx = context()
        except ValueError as exc:             # a platform without the forkserver
            raise WorkersUnavailable(f"no {START_METHOD} start method here ({exc})") from exc
        self.args = (os.getpid(), threads or default_threads(self.size), initializer, initargs)
        self.workers: list[_Worker] = []

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker (also the busy ones); idempotent."""
        workers, self.workers = self.workers, []
        for w in workers:
            if w.task is None:                # idle: ask it to leave, no signal needed
                with contextlib.suppress(OSError, ValueError):
                    w.conn.send(None)
        for w in workers:
            w.stop()

    def _idle(self) -> _Worker:
        for w in self.workers:
            if w.task is None:
                return w
        try:
            w = _Worker(self.ctx, self.args)
        except (OSError, RuntimeError, ValueError) as exc:
            raise WorkersUnavailable(f"cannot start a worker process ({exc})") from exc
        self.workers.append(w)
        return w

    def _retire(self, w: _Worker) -> None:
        self.workers.remove(w)
        w.stop()

    @staticmethod
    def _receive(w: _Worker) -> tuple[tuple[int, Any] | None, bool]:
        """(the task's (index, result) if the worker sent it, whether its pipe closed)."""
        while w.conn.poll():
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                return None, True
            if msg == READY:              # the task's clock starts once the worker runs
                w.ready, w.started = True, time.monotonic()
                continue
            index, ok, value = msg
            return (index, value if ok else Failed(f"raised {value}")), False
        return None, False

    def imap(self, fn: Callable, tasks: Sequence[Any], timeout: float | None
             ) -> Iterator[tuple[int, Any]]:
        """(task index, result or Failed) as tasks finish; ``timeout``: seconds per task."""
        todo = deque(range(len(tasks)))
        with _sigterm_unwinds():
            while todo or any(w.task is not None for w in self.workers):
                while todo and (len(self.workers) < self.size
                                or any(w.task is None for w in self.workers)):
                    i = todo.popleft()
                    self._idle().give(i, fn, tasks[i])
                yield from self._collect(timeout)

    def _collect(self, timeout: float | None) -> Iterator[tuple[int, Any]]:
        busy = [w for w in self.workers if w.task is not None]
        now = time.monotonic()
        left = None if timeout is None else max(0.0, min(w.started + timeout for w in busy) - now)
        ready = set(wait_any([w.conn for w in busy] + [w.proc.sentinel for w in busy], left))
        for w in busy:
            index = w.task
            reply, closed = self._receive(w) if w.conn in ready else (None, False)
            if reply is not None:
                w.task = None
                yield reply
            elif closed or w.proc.sentinel in ready:
                self._retire(w)
                if not w.ready:
                    raise WorkersUnavailable(f"a worker process exited while starting "
                                             f"(exit code {w.proc.exitcode})")
                yield index, Failed(f"its worker process died (exit code {w.proc.exitcode})")
            elif timeout is not None and time.monotonic() - w.started >= timeout:
                self._retire(w)
                yield index, Failed(f"still running after {timeout:g} s: its worker was stopped")


def run_bounded(fn: Callable, tasks: Iterable[Any], workers: int, timeout: float | None,
                initializer: Callable | None = None, initargs: tuple = ()
                ) -> Iterator[tuple[int, Any]]:
    """Results of ``fn`` over ``tasks`` in a Pool that is always stopped at the end."""
    tasks = list(tasks)
    with Pool(workers, initializer, initargs) as pool:
        yield from pool.imap(fn, tasks, timeout)
