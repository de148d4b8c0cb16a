"""When the flight recorder fires: the trigger rules, judged at the step boundary, agreed by
every rank with one small all-reduce.

Why agreed: a trigger writes the ring and turns full capture on for the next J iterations;
were one rank to capture and its peers not, their captures would disagree on what iteration
they hold and a rank could stall in a collective the others skip. Each rank judges what it
sees, ``budget.max_over_ranks`` takes the maximum of every flag (one all-reduce of
len(KINDS) + 1 float64 values), and every rank then acts on the same agreed flags.

The rules (a table; each rank's local view):

- ``nonfinite``: a NaN or Inf in any statistic recorded this iteration, or a non-finite loss;
- ``loss_spike``: the loss above its adaptive baseline (tensor_capture.adaptive, the monitor's
  rule: warm-up, rolling mean + sigma x spread, or twice the warm-up's largest);
- ``grad_norm_spike``: the gradient norm the training loop reported (``recorder.report``) above
  its baseline by the same rule, with a wider least spread (``GRAD_REL_FLOOR``);
- ``flush_jump``: a site's flush-to-zero ratio in the run's format above its own baseline by at
  least ``FLUSH_FLOOR`` (only where the format is not the tensor's own dtype);
- ``user_request``: ``<save_dir>/TRIGGER`` created or touched since it was last honoured, or
  SIGUSR1 received.

A kind that fired stays quiet until an iteration in which it is not flagged on any rank (a NaN
that poisoned the weights triggers once, not every iteration after).
"""
from __future__ import annotations

import math
import os
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .. import budget, schema
from ..adaptive import AdaptiveThreshold
from ..config import CaptureConfig
from .ring import IterStats, SlotBook

KINDS = ("nonfinite", "loss_spike", "grad_norm_spike", "flush_jump", "user_request")
#: the least rise of a flush-to-zero ratio (share of elements) that counts as a jump
FLUSH_FLOOR = 0.01
#: the gradient norm's least spread, as a share of its rolling mean
GRAD_REL_FLOOR = 1.5
#: the rolling window of the adaptive rules (iterations)
WINDOW = 50
_NONE = -1e300        # "no iteration flagged" in the agreement vector (every rank's max)


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
        self.armed = {k: True for k in KINDS}
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
    def judge(self, book: SlotBook, entry: IterStats) -> dict[str, Any]:
        """The kinds flagged on this rank in ``entry`` -> what was seen (JSON-able)."""
        out: dict[str, Any] = {}
        slot = book.first_nonfinite(entry)
        if slot is not None:
            info = book.sites[book.slot_site[slot]]
            out["nonfinite"] = {"module_path": info.site.module_path,
                                "tensor_name": info.site.tensor_name,
                                "operation": info.site.operation,
                                "sample_idx": book.slot_sample[slot], "slot": slot}
        loss = entry.loss
        if not math.isnan(loss) and not math.isfinite(loss):
            out.setdefault("nonfinite", {"loss": loss})
        if math.isfinite(loss) and bool(self.loss.update(loss)[0]):
            out["loss_spike"] = {"loss": loss, "baseline": _baseline(self.loss)}
        jump = self._flush_jump(book, entry)
        if jump is not None:
            out["flush_jump"] = jump
        return out

    def judge_grad_norms(self) -> dict[int, dict[str, Any]]:
        """The gradient norms reported since the last judgement, by the iteration they
        belong to -> the kinds they flag."""
        out: dict[int, dict[str, Any]] = {}
        for it, norm in self.grad_norms:
            if not math.isfinite(norm):
                out.setdefault(it, {}).setdefault("nonfinite", {"grad_norm": norm})
            elif bool(self.grad.update(norm)[0]):
                out.setdefault(it, {})["grad_norm_spike"] = {
                    "grad_norm": norm, "baseline": _baseline(self.grad)}
        self.grad_norms = []
        return out

    def _flush_jump(self, book: SlotBook, entry: IterStats) -> dict[str, Any] | None:
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
        values = [0.0] * len(KINDS) + [_NONE]
        for it, kinds in sorted(flagged.items(), reverse=True):
            for k in kinds:
                values[KINDS.index(k)] = 1.0
            if kinds:
                values[-1] = float(-it)
        agreed = budget.max_over_ranks(values)
        fired = []
        for k, v in zip(KINDS, agreed):
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
