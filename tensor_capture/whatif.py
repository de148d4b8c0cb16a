"""What-if numerics of a captured tensor: quant.whatif for each configured format, along the
reduction axis of the GEMM the tensor feeds (quant.gemm_plan's axis, passed by the hooks as
``quant_axis``), else along the last axis.

Why its own module: the saver plans it on the training thread and stages the (sampled) tensor on
the host with the other copies, and the writer thread computes it, so the training step never
waits for the quantizations (CUDA tensors: a pinned non-blocking copy of at most
``whatif_max_elements`` elements).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from . import schema


class WhatifPlan(NamedTuple):
    """What to compute for one tensor: the formats and the axis (and where the axis came from),
    and at most how many elements to analyse (None: all)."""

    formats: tuple[str, ...]
    axis: int
    source: str
    max_elements: int | float | None = None


def plan(formats: tuple[str, ...], tensor: torch.Tensor, variant: str,
         quant_axis: int | None, max_elements: int | float | None = None) -> WhatifPlan | None:
    """The plan of a captured tensor; None when there is nothing to compute (no formats, a
    quantized operand, an empty or non-floating tensor)."""
    if (not formats or variant != schema.VARIANT_HP or tensor.numel() == 0
            or not tensor.is_floating_point()):
        return None
    if quant_axis is None:
        return WhatifPlan(formats, -1, schema.AXIS_LAST, max_elements)
    return WhatifPlan(formats, quant_axis, schema.AXIS_FROM_GEMM, max_elements)


def sample(x: torch.Tensor, axis: int, max_elements: int | float | None) -> torch.Tensor:
    """A strided subset of ``x`` of at most ``max_elements`` elements (when possible), taken
    along the dimensions other than ``axis`` so that every block along ``axis`` stays whole.
    A view: the caller's whole tensor is never copied for it."""
    if max_elements is None or x.dim() < 2 or x.numel() <= max_elements:
        return x
    a = axis % x.dim()
    index: list[slice] = [slice(None)] * x.dim()
    numel = x.numel()
    for d in sorted((d for d in range(x.dim()) if d != a), key=lambda d: -x.shape[d]):
        if numel <= max_elements:
            break
        size = x.shape[d]
        other = numel // size
        step = -(-size // max(1, int(max_elements // other)))
        index[d] = slice(None, None, step)
        numel = other * len(range(0, size, step))
    return x[tuple(index)]


def compute(part: torch.Tensor, p: WhatifPlan, total: int) -> dict[str, Any]:
    """The metadata value stored under schema.META_WHATIF, from ``part`` (the tensor or its
    :func:`sample`) of a tensor of ``total`` elements."""
    from quant.whatif import whatif_set

    return {schema.WHATIF_AXIS: p.axis, schema.WHATIF_AXIS_SOURCE: p.source,
            schema.WHATIF_ELEMENTS: part.numel(), schema.WHATIF_SAMPLED: part.numel() < total,
            schema.WHATIF_FORMATS: whatif_set(part, p.formats, p.axis)}


class WhatifGate:
    """Keeps what-if numerics within ``budget`` of wall time (config ``whatif_budget``).

    Why: five quantizations per tensor cost far more than the statistics on a CPU (each is
    hundreds of small torch ops), and a run must be able to leave them on. The writer thread
    charges the seconds each job took by this gate's clock (wall time: what the job kept the
    writer from the statistics and files queued behind it, and, sharing the GIL, the training
    thread from its Python; charged CPU time, a 0.25 budget cost 1.5-1.9x the statistics
    alone on the embedded tiny Llama, charged wall time 1.3x: docs/capture.md). The saver asks
    :meth:`open` at the first capture of each iteration, and an iteration gets what-if numerics
    while the seconds charged so far are at most ``budget`` x the wall time since the first
    one (the first always does). A skipped iteration keeps its statistics; only its ``whatif``
    metadata is absent, for every tensor of that iteration alike, so a timeline point is whole
    or missing, never partial. ``budget`` None: every due iteration.
    """

    def __init__(self, budget: float | None, clock: Callable[[], float] = time.perf_counter):
        self.budget = budget
        self.spent = 0.0                     # seconds of what-if jobs so far
        self.on: list[int] = []              # iterations that got what-if numerics
        self.skipped: list[int] = []         # iterations skipped to stay within the budget
        self.clock = clock                   # what jobs are timed by, too
        self._start: float | None = None
        self._decided: tuple[int, bool] | None = None
        self._lock = threading.Lock()

    def open(self, iteration: int) -> bool:
        """Does ``iteration`` get what-if numerics? (decided once per iteration)"""
        if self._decided is not None and self._decided[0] == iteration:
            return self._decided[1]
        now = self.clock()
        if self._start is None:
            self._start = now
        with self._lock:
            spent = self.spent
        ok = self.budget is None or not self.on or spent <= self.budget * (now - self._start)
        (self.on if ok else self.skipped).append(iteration)
        self._decided = (iteration, ok)
        return ok

    def charge(self, seconds: float) -> None:
        with self._lock:
            self.spent += seconds


@dataclass
class WhatifJob:
    """What-if numerics left to the writer thread: the plan, the host copy of the tensor or
    its sample (``source``), and the tensor's element count."""

    plan: WhatifPlan
    source: torch.Tensor | None
    total: int
    gate: WhatifGate | None = field(default=None, repr=False)   # charged with the job's time

    def run(self, whole: torch.Tensor | None = None) -> dict[str, Any]:
        """The metadata value; ``whole``: the writer's host copy of the whole tensor, used
        when no separate source was staged."""
        clock = self.gate.clock if self.gate is not None else time.perf_counter
        t0 = clock()
        src = self.source if self.source is not None else sample(
            whole, self.plan.axis, self.plan.max_elements)
        out = compute(src, self.plan, self.total)
        if self.gate is not None:
            self.gate.charge(clock() - t0)
        return out
