"""Iteration and sample numbers from megatron-core's own schedule.

Why here and not in the training loop: ``pretrain_gpt.py`` (and any loop built on megatron-core)
calls ``get_forward_backward_func()(...)`` once per training iteration, and that schedule calls
``forward_step_func`` once per micro-batch and model chunk. The patched
``get_forward_backward_func`` returns :func:`wrap_schedule` of the schedule, so capture knows
both numbers with no saver call in the loop.

- iteration: each call of the schedule with ``forward_only=False`` is one iteration. The first
  one is, in order of precedence: ``TENSOR_SAVER_ITERATION``; :func:`resume_at` (our driver after
  loading a checkpoint); Megatron-LM's ``args.iteration`` (completed iterations, set from the
  checkpoint) when ``megatron.training.global_vars`` is loaded and holds it; else the saver's
  iteration (0). Each further call adds one.
- sample: the index of the micro-batch within the iteration, 0-based, counted per model chunk
  (micro-batch m has sample m in every chunk and on every pipeline stage). The linear and
  attention hooks record it at forward, so the backward of micro-batch m carries m too.
- ``forward_only=True`` (evaluation): does not count as an iteration and captures nothing;
  emulation still applies, so the evaluation loss is the emulated model's.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

from quant.vocabulary import ENV_ITERATION

from . import budget
from .saver import get_tensor_saver, stop_capture
from .state import STATE


class _Numbering:
    """This session's count (a STATE session part: a new session, configure() or
    reset_tensor_saver(), starts it afresh)."""
    __slots__ = ("next_iteration", "resume", "running", "budget_agreed")

    def __init__(self) -> None:
        self.next_iteration: int | None = None   # None until the first training call
        self.resume: int | None = None
        self.running = False
        self.budget_agreed = False   # the ranks have agreed on the byte-budget stop


def _n() -> _Numbering:
    return STATE.session(_Numbering)


def reset() -> None:
    """Forget the count."""
    STATE.forget(_Numbering)


def resume_at(iteration: int) -> None:
    """The first training call is ``iteration`` (completed iterations of a resumed run), unless
    TENSOR_SAVER_ITERATION overrides. Call before the first training iteration."""
    _n().resume = int(iteration)


def megatron_args_iteration() -> int | None:
    """Megatron-LM's ``args.iteration`` when megatron.training is loaded and has set it."""
    gv = sys.modules.get("megatron.training.global_vars")
    args = getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None
    it = getattr(args, "iteration", None)
    return it if isinstance(it, int) and not isinstance(it, bool) and it >= 0 else None


def first_iteration(saver: Any, env: Any = os.environ) -> int:
    if env.get(ENV_ITERATION, "").strip():
        return saver.config.iteration          # validated by the config
    resume = _n().resume
    if resume is not None:
        return resume
    from_args = megatron_args_iteration()
    return from_args if from_args is not None else saver.iteration


def _model_of(args: tuple, kwargs: dict) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("model")


def _counting(step: Callable[..., Any], saver: Any) -> Callable[..., Any]:
    counts: dict[int, int] = {}

    @functools.wraps(step)          # keeps the signature megatron may inspect
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        key = id(_model_of(args, kwargs))
        idx = counts.get(key, 0)
        counts[key] = idx + 1
        saver.set_sample_idx(idx)
        return step(*args, **kwargs)

    return forward_step


def _replace_step(args: tuple, kwargs: dict, wrap: Callable[[Any], Any]) -> tuple[tuple, dict]:
    if "forward_step_func" in kwargs:
        kwargs = dict(kwargs, forward_step_func=wrap(kwargs["forward_step_func"]))
    elif args:
        args = (wrap(args[0]),) + tuple(args[1:])
    return args, kwargs


def _run_eval(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    was = STATE.paused
    STATE.paused = True
    try:
        return func(*args, **kwargs)
    finally:
        STATE.paused = was


def _run_training(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    saver = get_tensor_saver()
    n = _n()
    if n.next_iteration is None:
        n.next_iteration = first_iteration(saver)
        if saver.enabled and saver.guard is not None:   # a resumed run keeps its decisions
            saver.guard.resume(n.next_iteration)
    it = n.next_iteration
    saver.set_iteration(it)
    args, kwargs = _replace_step(args, kwargs, lambda f: _counting(f, saver))
    n.running = True
    try:
        out = func(*args, **kwargs)
    except (Exception, SystemExit) as exc:
        # the step died inside the schedule (Megatron-LM's own NaN check raises there): the
        # flight recorder writes what it holds, this rank alone, before the run ends
        if saver.enabled and saver.recorder is not None:
            saver.recorder.dump_on_error(it, exc)
        raise
    finally:
        n.running = False
        n.next_iteration = it + 1
        saver.set_sample_idx(None)
    end_iteration(saver, it, out)
    return out


def stop_if_over_budget(saver: Any, iteration: int) -> None:
    """A byte budget that could not hold this iteration on any rank stops every rank here,
    with the line the rank that ran out printed and status 2 (SystemExit: an exit of the
    training loop, at a step boundary; the writer drains first so files stay whole).

    The ranks agree once per session, after the first iteration the capture window selects
    (budget.agreement_due: all ranks reach that call together); a later, rank-local
    overflow, which a budget that held one iteration cannot raise, would stop its rank alone.

    Why SystemExit and nothing harder: it is what ``sys.exit(2)`` in the training loop would
    do, so the loop loses nothing it would keep on an ordinary exit: its ``finally`` blocks and
    context managers, atexit handlers (the capture writer's drain, a user's loggers and
    trackers) and the flush of buffered stdout/stderr all run. ``os._exit`` would skip all of
    them, and destroying the process group would take it from under the user's own exit code.
    An exit with the process group alive is safe because the last collective, the agreement,
    leaves no tensor for a backend thread to release during interpreter shutdown (see
    budget.any_rank).
    """
    over = None
    if saver.enabled:
        try:
            saver.budget.check()
        except budget.CaptureBudgetError as exc:
            over = exc
    n = _n()
    stop = over is not None
    if not n.budget_agreed and budget.agreement_due(saver.config, iteration):
        n.budget_agreed = True
        stop = budget.any_rank(stop)
    if stop:
        saver.flush()
        raise SystemExit(budget.CaptureBudgetError.code) from over


def end_iteration(saver: Any, iteration: int, losses: Any = None) -> None:
    """After a training iteration: a budget that could not hold it ends the run on every rank;
    the flight recorder (recorder mode) takes its statistics to the host and judges its
    triggers (``losses``: what the schedule returned); when no later iteration can be
    captured, say so once and stop capturing (emulation goes on)."""
    stop_if_over_budget(saver, iteration)
    if not saver.enabled:
        return
    if saver.guard is not None:       # decisions apply from the next iteration
        saver.guard.end_iteration(iteration)
    if saver.recorder is not None and saver.recorder.end_iteration(iteration, losses):
        saver.flush()                 # the triggered capture on disk, then a clean exit
        raise SystemExit(0)
    reason = budget.finished_reason(saver.config, saver.saved_iterations, iteration + 1)
    if reason is None:
        return
    line = budget.stop_line(saver, iteration, reason)
    stop_capture(saver)
    budget.announce(line)


def wrap_schedule(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (a megatron-core forward-backward schedule) numbering iterations and samples.

    Same signature; a pass-through while capture and emulation are off.
    """
    if getattr(func, "_tensor_capture_schedule", False):
        return func

    @functools.wraps(func)
    def schedule(*args: Any, **kwargs: Any) -> Any:
        if not STATE.active or _n().running:
            return func(*args, **kwargs)
        if kwargs.get("forward_only", False):
            return _run_eval(func, args, kwargs)
        return _run_training(func, args, kwargs)

    schedule._tensor_capture_schedule = True
    return schedule
