"""When the flight recorder fires: the trigger rules, judged at the step boundary, agreed by
every rank with one small all-reduce.

Why agreed: a trigger writes the ring and turns full capture on for the next J iterations;
were one rank to capture and its peers not, their captures would disagree on what iteration
they hold and a rank could stall in a collective the others skip. Each rank judges what it
sees, ``budget.max_over_ranks`` takes the maximum of every flag (one all-reduce of
len(agreed_kinds()) + 1 float64 values), and every rank then acts on the same agreed flags.

The rules are rows of :data:`TRIGGERS`, ``Trigger(name, judge, inputs)``: the recorder gathers
what each iteration shows (:class:`Seen`: its statistics, its loss, the gradient norms reported
for it, the user's request, the step's error) and judges every row whose inputs are there, in
row order; adding a trigger is one row. The rows (each rank's local view):

- ``nonfinite``: a non-finite gradient norm reported for the iteration, else a NaN or Inf in
  any statistic recorded in it (the first in execution order), else an infinite loss;
- ``loss_spike``: the loss above its adaptive baseline (tensor_capture.adaptive, the monitor's
  rule: warm-up, rolling mean + sigma x spread, or twice the warm-up's largest);
- ``grad_norm_spike``: the gradient norm the training loop reported (``recorder.report``) above
  its baseline by the same rule, with a wider least spread (``GRAD_REL_FLOOR``);
- ``flush_jump``: a site's flush-to-zero ratio in the run's format above its own baseline by at
  least ``FLUSH_FLOOR`` (only where the format is not the tensor's own dtype);
- ``user_request``: ``<save_dir>/TRIGGER`` created or touched since it was last honoured, or
  SIGUSR1 received;
- ``error``: the step raised (its input, ``error``, exists only then): judged by this rank alone
  in :meth:`Recorder.dump_on_error`, never agreed (the other ranks may be anywhere).

A kind that fired stays quiet until an iteration in which it is not flagged on any rank (a NaN
that poisoned the weights triggers once, not every iteration after).
"""
from __future__ import annotations

import math
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import budget, schema
from ..adaptive import AdaptiveThreshold
from ..config import CaptureConfig
from .ring import IterStats, SlotBook

#: the least rise of a flush-to-zero ratio (share of elements) that counts as a jump
FLUSH_FLOOR = 0.01
#: the gradient norm's least spread, as a share of its rolling mean
GRAD_REL_FLOOR = 1.5
#: the rolling window of the adaptive rules (iterations)
WINDOW = 50
_NONE = -1e300        # "no iteration flagged" in the agreement vector (every rank's max)


@dataclass
class Seen:
    """What one iteration shows the triggers; an input that is not there is None. ``stats``:
    the recorder's books and the iteration's statistics; ``loss``: the schedule's; ``grad_norm``:
    the norms the training loop reported for it (``recorder.report``), in order; ``request``:
    the user's (once per judgement, on its last iteration); ``error``: the step's exception."""

    iteration: int
    stats: tuple[SlotBook, IterStats] | None = None
    loss: float | None = None
    grad_norm: list[float] | None = None
    request: dict[str, Any] | None = None
    error: str | None = None


#: a judge: (this rank's rules, what the iteration shows) -> what it saw (JSON-able), or None
Judge = Callable[["TriggerRules", Seen], "dict[str, Any] | None"]


@dataclass(frozen=True)
class Trigger:
    """One trigger: its name (the trigger records' ``kinds``), its judge, and the inputs it reads
    (fields of :class:`Seen`): it is judged on an iteration that shows at least one of them."""

    name: str
    judge: Judge
    inputs: tuple[str, ...]

    def reads(self, seen: Seen) -> bool:
        return any(getattr(seen, i) is not None for i in self.inputs)


def _nonfinite(rules: "TriggerRules", seen: Seen) -> dict[str, Any] | None:
    """A non-finite reported gradient norm, else the first non-finite tensor (execution
    order), else a non-finite loss."""
    bad = [g for g in seen.grad_norm or () if not math.isfinite(g)]
    if bad:
        return {"grad_norm": bad[0]}
    if seen.stats is not None:
        book, entry = seen.stats
        slot = book.first_nonfinite(entry)
        if slot is not None:
            site = book.sites[book.slot_site[slot]].site
            return {"module_path": site.module_path, "tensor_name": site.tensor_name,
                    "operation": site.operation, "sample_idx": book.slot_sample[slot],
                    "slot": slot}
    loss = seen.loss
    if loss is not None and not math.isnan(loss) and not math.isfinite(loss):
        return {"loss": loss}
    return None


def _loss_spike(rules: "TriggerRules", seen: Seen) -> dict[str, Any] | None:
    loss = seen.loss
    if loss is not None and math.isfinite(loss) and bool(rules.loss.update(loss)[0]):
        return {"loss": loss, "baseline": _baseline(rules.loss)}
    return None


def _grad_norm_spike(rules: "TriggerRules", seen: Seen) -> dict[str, Any] | None:
    """The last finite norm above its baseline (every finite one updates it)."""
    out = None
    for norm in seen.grad_norm or ():
        if math.isfinite(norm) and bool(rules.grad.update(norm)[0]):
            out = {"grad_norm": norm, "baseline": _baseline(rules.grad)}
    return out


def _flush_jump(rules: "TriggerRules", seen: Seen) -> dict[str, Any] | None:
    return rules.flush_jump(*seen.stats) if seen.stats is not None else None


def _asked(rules: "TriggerRules", seen: Seen) -> dict[str, Any] | None:
    return seen.request


def _error(rules: "TriggerRules", seen: Seen) -> dict[str, Any] | None:
    return {"error": seen.error} if seen.error is not None else None


#: the triggers, one row each; the row order is the order of a trigger record's ``kinds``
TRIGGERS = (
    Trigger("nonfinite", _nonfinite, ("stats", "loss", "grad_norm")),
    Trigger("loss_spike", _loss_spike, ("loss",)),
    Trigger("grad_norm_spike", _grad_norm_spike, ("grad_norm",)),
    Trigger("flush_jump", _flush_jump, ("stats",)),
    Trigger("user_request", _asked, ("request",)),
    Trigger("error", _error, ("error",)),
)
#: the input that exists only when a step raised: its triggers are this rank's alone
RANK_ALONE = "error"


def agreed_kinds() -> tuple[str, ...]:
    """The triggers every rank agrees on at the step boundary (all but those reading
    :data:`RANK_ALONE`), in row order."""
    return tuple(t.name for t in TRIGGERS if RANK_ALONE not in t.inputs)


def rank_alone(fired: dict[str, Any]) -> list[str]:
    """The kinds among ``fired`` that this rank decides alone (they read :data:`RANK_ALONE`)."""
    return [t.name for t in TRIGGERS if RANK_ALONE in t.inputs and t.name in fired]


class _Signal:
    """SIGUSR1 as a flag (installed only where nothing else handles it, main thread only)."""

    def __init__(self) -> None:
        self.raised = False
        self.installed = False
        sig = getattr(signal, "SIGUSR1", None)
        if sig is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, self._on)
            self.installed = True

    def restore(self) -> None:
        """Give SIGUSR1 back its default (the session ended)."""
        if self.installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            self.installed = False

    def _on(self, signum: int, frame: Any) -> None:
        self.raised = True

    def take(self) -> bool:
        raised, self.raised = self.raised, False
        return raised


class TriggerRules:
    """The rules' state on this rank: baselines, armed kinds, the user's request."""

    def __init__(self, config: CaptureConfig) -> None:
        c = config
        self.loss = AdaptiveThreshold(c.recorder_warmup, c.recorder_sigma, WINDOW, "up")
        # a healthy run's gradient norm jumps 5x now and then (the tiny Llama: 6.0 over a mean
        # of 1.2 at iteration 20): judged against a spread of at least 1.5 times its rolling
        # mean (a spike at the default sigma 6: 10 times it), with no range doubling
        self.grad = AdaptiveThreshold(c.recorder_warmup, c.recorder_sigma, WINDOW, "up",
                                      range_check=False, rel_floor=GRAD_REL_FLOOR)
        self.flush: AdaptiveThreshold | None = None
        self._flush_args = (c.recorder_warmup, c.recorder_sigma, WINDOW, "up")
        self.armed = {k: True for k in agreed_kinds()}
        self.trigger_file = Path(c.save_dir) / schema.RECORDER_TRIGGER_FILE
        self._file_seen = self._file_stamp()
        self.signal = _Signal()
        self.grad_norms: list[tuple[int, float]] = []   # (iteration, norm) not yet judged

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.trigger_file)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    # -- one rank's view --------------------------------------------------------------------------
    def seen(self, book: SlotBook, entries: list[IterStats]) -> dict[int, Seen]:
        """What the iterations of ``entries`` and the gradient norms reported since the last
        judgement show, by iteration (the user's request on the last entry's)."""
        out = {e.iteration: Seen(e.iteration, stats=(book, e), loss=e.loss) for e in entries}
        for it, norm in self.grad_norms:
            view = out.setdefault(it, Seen(it))
            view.grad_norm = [*(view.grad_norm or ()), norm]
        self.grad_norms = []
        if entries:
            out[entries[-1].iteration].request = self.user_request()
        return out

    def judge(self, seen: dict[int, Seen]) -> dict[int, dict[str, Any]]:
        """{iteration: {kind: what it saw}} of every :data:`TRIGGERS` row on each iteration
        that shows one of its inputs (iterations in order, rows in order); iterations where
        nothing fired are left out."""
        flagged: dict[int, dict[str, Any]] = {}
        for it in sorted(seen):
            for trigger in TRIGGERS:
                if trigger.reads(seen[it]):
                    detail = trigger.judge(self, seen[it])
                    if detail is not None:
                        flagged.setdefault(it, {})[trigger.name] = detail
        return flagged

    def flush_jump(self, book: SlotBook, entry: IterStats) -> dict[str, Any] | None:
        """The first site whose flush-to-zero ratio in the run's format jumped (see above)."""
        judged = [s.fmt is not None and not s.fmt.own_dtype for s in book.sites]
        if not any(judged):
            return None
        merged = book.merged(entry)
        with np.errstate(all="ignore"):
            ratio = np.where(np.asarray(judged) & (merged["count"] > 0),
                             merged["flush_count"] / merged["count"], np.nan)
        if self.flush is None:
            warm, sigma, window, direction = self._flush_args
            self.flush = AdaptiveThreshold(warm, sigma, window, direction, range_check=False,
                                           abs_floor=FLUSH_FLOOR)
            self._flush_width = len(ratio)
        ratio = np.resize(ratio, self._flush_width) if len(ratio) != self._flush_width else ratio
        bad = self.flush.update(ratio)
        if not bad.any():
            return None
        i = int(np.flatnonzero(bad)[0])
        site = book.sites[i].site
        return {"module_path": site.module_path, "tensor_name": site.tensor_name,
                "operation": site.operation, "flush_ratio": float(ratio[i])}

    def user_request(self) -> dict[str, Any] | None:
        stamp = self._file_stamp()
        asked = stamp is not None and stamp != self._file_seen
        if asked:
            self._file_seen = stamp
            return {"file": str(self.trigger_file)}
        if self.signal.take():
            return {"signal": "SIGUSR1"}
        return None

    # -- every rank's agreement ----------------------------------------------------------------------
    def agree(self, flagged: dict[int, dict[str, Any]]) -> tuple[int | None, list[str]]:
        """(the earliest iteration any rank flagged, the kinds that fire there) from this rank's
        ``flagged`` {iteration: {kind: detail}}: one all-reduce; every rank gets the same."""
        names = agreed_kinds()
        values = [0.0] * len(names) + [_NONE]
        for it, kinds in sorted(flagged.items(), reverse=True):
            for k in kinds:
                values[names.index(k)] = 1.0
            if kinds:
                values[-1] = float(-it)
        agreed = budget.max_over_ranks(values)
        fired = []
        for k, v in zip(names, agreed):
            if v > 0 and self.armed[k]:
                fired.append(k)
            self.armed[k] = v <= 0      # re-armed by an iteration where no rank flags it
        if not fired:
            return None, []
        return int(-agreed[-1]), fired


def _baseline(th: AdaptiveThreshold) -> float | None:
    if not th.ready:
        return None
    mean, _ = th.reference()
    return float(mean[0])
