"""Default bounds of a capture run, and the one line that announces its start and its end.

Why: with only ``TENSOR_SAVE_ENABLED=true`` a long run must not fill the disk. The process-wide
saver (environment, ``TENSOR_SAVE_CONFIG``, ``configure()``) therefore gets, for every bound the
user left unset:

- ``max_iterations = min_iterations`` (default 1): the "iteration data guarantee" saves
  at least that many iterations and then stops; not applied when ``iterations.end`` is set (the
  window is bounded already);
- ``byte_budget = DISK_FRACTION`` of the free space under ``save_dir`` at start, shared by the
  ranks of this node (``LOCAL_WORLD_SIZE``).

``unlimited`` lifts either bound. A budget that cannot hold one whole iteration is a setup
mistake: the first iteration stops writing files when it runs out, and at its end the run exits
with one line and status 2. The rank that ran out raises :class:`CaptureBudgetError` (an
ordinary exception) from :meth:`ByteBudget.check`; the schedule wrapper
(tensor_capture.numbering) has every rank agree (:func:`any_rank`) and stop at that step
boundary, so no rank is left waiting in a collective for one that exited.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from lowp_common import human_bytes

from .config import MODE_RECORDER, CaptureConfig
from .ranks import global_rank
from .state import STATE

DISK_FRACTION = 0.5          # of the free disk at start, per node


class CaptureBudgetError(Exception):
    """The byte budget cannot hold one iteration (its line is printed where it is raised).

    An ordinary exception, so it never unwinds Megatron's schedule as an exit: the schedule
    wrapper turns it into a stop of every rank with status ``code``."""

    code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: an all-reduce over the default process group when
    torch.distributed runs more than one rank (every rank must call it at the same point),
    else ``flag`` itself.

    Why the work handle is kept (``STATE.agreement_work``, which a session reset leaves alone:
    the next agreement replaces it, a later session's too): a budget stop exits right after this
    collective, and its tensor must not be let go by a backend thread while the interpreter
    exits. In torch 2.13 a tensor that C++ code also holds keeps its Python object alive, and
    the thread that drops the last such C++ reference takes the GIL to release that object.
    ``all_reduce`` returns once gloo's worker thread has completed the work, but that thread
    drops the work, and with it the tensor, a moment later; if by then the interpreter is
    finalizing, CPython ends the thread as it takes the GIL (pthread_exit), the unwind through
    torch's noexcept destructor calls std::terminate, and the rank dies with "terminate called
    without an active exception" (SIGABRT, status -6) instead of exiting 2. With the handle
    held here the worker's drop is never the last one; the main thread's is, at the next
    agreement or at interpreter teardown (where torch no longer touches Python objects).
    """
    return bool(max_over_ranks([float(flag)])[0])


def max_over_ranks(values: list[float]) -> list[float]:
    """Each entry's maximum over the ranks: one all-reduce (MAX) of a small float64 vector
    over the default process group when more than one rank runs (every rank must call it at
    the same point with as many values), else ``values``. The agreement of :func:`any_rank`
    and of the flight recorder's triggers (tensor_capture.recorder.flight); the work handle is kept
    as :func:`any_rank` explains."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return list(values)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    vec = torch.tensor(values, dtype=torch.float64, device=device)
    work = dist.all_reduce(vec, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    STATE.agreement_work = work
    return vec.tolist()


def agreement_due(config: CaptureConfig, iteration: int) -> bool:
    """Whether the ranks must agree on a budget stop after ``iteration``: the first iteration
    the capture window selects (only there can a budget prove too small for one iteration).
    Decided from the configuration alone, which every rank shares, never from what one rank
    saved; the caller asks once per session."""
    c = config
    if not c.enabled or c.stats_only or c.byte_budget == math.inf:
        return False
    return (iteration >= c.iter_start and (c.iter_end is None or iteration <= c.iter_end)
            and (iteration - c.iter_start) % c.iter_every == 0)


def free_bytes(directory: str | os.PathLike[str]) -> int:
    """Free bytes on the file system that holds ``directory`` (or its nearest existing parent)."""
    p = Path(directory).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def local_ranks(env: Mapping[str, str] = os.environ) -> int:
    try:
        return max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def bounded(config: CaptureConfig, env: Mapping[str, str] = os.environ,
            free: int | None = None) -> tuple[CaptureConfig, dict[str, str]]:
    """``config`` with the default bounds filled in, plus a note per default applied."""
    changes: dict[str, Any] = {}
    notes: dict[str, str] = {}
    if config.max_iterations is None and config.mode == MODE_RECORDER:
        changes["max_iterations"] = math.inf   # the recorder bounds itself: J per trigger
    elif config.max_iterations is None and config.iter_end is None:
        changes["max_iterations"] = max(config.min_iterations, 1)
        notes["max_iterations"] = "default: min_iterations"
    if config.byte_budget is None and config.enabled and not config.stats_only:
        try:
            space = free_bytes(config.save_dir) if free is None else free
        except OSError:          # unreadable location: the writer reports it at first save
            space = None
        if space is not None:
            ranks = local_ranks(env)
            changes["byte_budget"] = int(space * DISK_FRACTION / ranks)
            per = f" over {ranks} local ranks" if ranks > 1 else ""
            notes["byte_budget"] = (f"default: {DISK_FRACTION:.0%} of {human_bytes(space)} "
                                    f"free{per}")
    return (replace(config, **changes) if changes else config), notes


def announce(line: str) -> None:
    """Print a capture-wide line once per job (global rank 0), on stderr."""
    if global_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def start_line(config: CaptureConfig, notes: Mapping[str, str]) -> str:
    """What will be captured, where, and until when (one line)."""
    c = config
    what = "+".join(c.layer_types) + " " + "+".join(c.operations)
    filters = [f"{k}={v}" for k, v in (("layers", c.layers), ("module_regex", c.module_regex),
                                       ("tensor_names", c.tensor_names), ("ranks", c.ranks))
               if v is not None]
    if filters:
        what += " (" + ", ".join(filters) + ")"
    mode = "statistics of" if c.stats_only else "tensors and statistics of"
    emu = f", emulating {c.quant_type}" if c.emulating else ""
    window = f"iterations {c.iter_start}..{'' if c.iter_end is None else c.iter_end}"
    if c.iter_every > 1:
        window += f" every {c.iter_every}"
    most = c.max_iterations
    until = f"at most {most} saved iteration(s)" if most not in (None, math.inf) else "no iteration limit"
    if "max_iterations" in notes:
        until += f" ({notes['max_iterations']})"
    budget = "no byte limit" if c.byte_budget in (None, math.inf) else (
        f"{human_bytes(c.byte_budget)} of files per rank")
    if "byte_budget" in notes:
        budget += f" ({notes['byte_budget']})"
    return (f"tensor capture: {mode} {what}{emu} -> {c.save_dir}; {window}, {until}, {budget}; "
            "change with max_iterations / byte_budget / iterations in TENSOR_SAVE_CONFIG")


def announce_start(config: CaptureConfig, notes: Mapping[str, str]) -> None:
    if config.enabled:
        announce(start_line(config, notes))


def finished_reason(config: CaptureConfig, saved: set[int] | list[int], next_iteration: int) -> str | None:
    """Why no later iteration can be captured, or None while some still can."""
    c = config
    if c.max_iterations not in (None, math.inf) and len(saved) >= c.max_iterations and (
            next_iteration not in saved):
        return f"max_iterations={c.max_iterations} reached"
    if c.iter_end is not None and next_iteration > c.iter_end:
        return f"iterations end={c.iter_end} passed"
    return None


def stop_line(saver: Any, last_iteration: int, reason: str) -> str:
    saved = saver.saved_iterations
    its = f"{saved[0]}..{saved[-1]}" if len(saved) > 1 else (str(saved[0]) if saved else "none")
    gate = getattr(saver, "whatif_gate", None)
    whatif = ""
    if gate is not None and gate.skipped:
        whatif = (f"; what-if numerics on {len(gate.on)} of {len(gate.on) + len(gate.skipped)} "
                  f"iteration(s), within whatif_budget={gate.budget:g} of wall time")
    return (f"tensor capture: stopped after iteration {last_iteration} ({reason}): "
            f"{len(saved)} iteration(s) saved ({its}), {human_bytes(saver.bytes_saved)} of files "
            f"on rank {global_rank()} in {saver.directory}{whatif}"
            + "".join(f"; {n}" for n in STATE.stop_notes()))


class ByteBudget:
    """Bytes against the budget. The first saved iteration must fit whole; later ones (up to
    min_iterations) may exceed it with a warning; after that files stop (statistics go on)."""

    def __init__(self, budget: float | None, min_iterations: int) -> None:
        self.budget = budget
        self.min_iterations = min_iterations
        self.first: int | None = None       # the first iteration that saved anything
        self.first_needed = 0               # bytes the first iteration asked for
        self.too_small = False

    def allows(self, used: int, nbytes: int, it: int, saved: set[int],
               warn: Callable[[str, str], None]) -> bool:
        if self.first is None:
            self.first = it
        if it == self.first:
            self.first_needed += nbytes
        if self.budget is None or used + nbytes <= self.budget:
            return True
        if it == self.first:
            self.too_small = True
            return False
        if len(saved - {it}) < self.min_iterations:
            warn("budget-min", f"tensor capture: byte_budget={human_bytes(self.budget)} exceeded "
                 f"to complete min_iterations={self.min_iterations}")
            return True
        warn("budget", f"tensor capture: byte_budget={human_bytes(self.budget)} reached; "
             "recording statistics only from now on")
        return False

    def check(self, rank: int | None = None) -> None:
        """Raise CaptureBudgetError (after printing its line) when one iteration did not fit."""
        if not self.too_small:
            return
        self.too_small = False      # say it once
        msg = (f"tensor capture: byte_budget {human_bytes(self.budget)} per rank cannot hold one "
               f"iteration (iteration {self.first} needs {human_bytes(self.first_needed)} on rank "
               f"{global_rank() if rank is None else rank}); raise byte_budget (e.g. '20GB' or "
               "'unlimited' in TENSOR_SAVE_CONFIG), free disk space, or capture less (layers, "
               "module_regex, tensor_names, max_rows, stats_only)")
        print(msg, file=sys.stderr, flush=True)   # on the rank that ran out
        raise CaptureBudgetError(msg)
