"""The flight recorder (config ``mode: recorder``): always on through a long run, the failing
iteration captured when it happens.

Why: capturing every iteration of a 100,000-iteration run costs step time and one manifest line
per tensor, micro-batch, rank and iteration; capturing iteration 0 misses the fault. The
recorder keeps, for every site the capture policy selects, a few mergeable statistics per
micro-batch (tensor_capture.recorder.stats: computed where the tensor lives, into a buffer, no
host sync inside the step), moves them to the host once per iteration (or every N) at the
step boundary, keeps the last W iterations in a ring and writes a summary row per site every K
iterations. When a trigger fires on any rank (tensor_capture.recorder.triggers: agreed by all),
every rank writes its ring as ordinary stats-only manifest records, captures the next J
iterations in full through the saver's normal path, and writes how to replay the fault from the
last checkpoint (tensor_capture.recorder.replay); then it goes back to recording, or stops
the run when asked (``recorder_stop_on_trigger``).

Who calls what: the saver routes each selected tensor to :meth:`Recorder.record` outside a
capture window (tensor_capture.saver); the schedule wrapper calls :meth:`Recorder.end_iteration`
with the schedule's loss dicts (tensor_capture.numbering); a training loop may add
:func:`report` (its gradient norm) and :func:`set_run_info` (how to resume it), as
``llama-train`` does. Layout of the output: docs/capture.md "Recorder mode".
"""
from __future__ import annotations

import atexit
import ctypes
import math
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from lowp_common import human_bytes
from quant.optional import OptionalModule

from .. import budget, schema
from ..config import CaptureConfig
from ..schema import CaptureSite
from ..state import STATE
from .out import SummaryWriter, append_trigger, ring_records, write_ring
from .replay import RunInfo, write_replay
from .ring import SLOT_BYTES, SlotBook, ring_bytes
from .stats import bounds, device_row, host_row, judged_format
from .triggers import Seen, TriggerRules, agreed_kinds, rank_alone

__all__ = ["Recorder", "report", "set_run_info", "ring_bytes", "RunInfo"]


class Recorder:
    """One capture session's recorder (owned by its TensorSaver)."""

    #: CPU tensors take the host path (False: the device path, as for CUDA; tests use it)
    host_path: bool = True
    #: the host path's rows by the one-pass C kernel (tensor_capture.stats_cpu) where it builds
    #: (False: the torch passes; bench/bench_capture.py's recorder_torch mode compares the two)
    cpu_kernel: bool = True

    def __init__(self, config: CaptureConfig, directory: Path, rank_info: Callable[[], dict],
                 label: Callable[[CaptureSite, torch.dtype], str],
                 warn: Callable[[str, str], None]) -> None:
        self.config = config
        self.directory = Path(directory)
        self.out_dir = self.directory / schema.RECORDER_DIR
        self._rank_info = rank_info
        self._label = label
        self._warn = warn
        self.book = SlotBook(config.recorder_window, config.recorder_every)
        self.rules = TriggerRules(config)
        self.summaries: SummaryWriter | None = None
        self.block: list[int] = []          # iterations in the buffer now (at most N)
        self.losses: list[float] = []
        self._plane = 0
        self.capture_from = self.capture_until = -1   # full capture of these iterations
        self._stop_after: int | None = None
        self.triggers: list[dict[str, Any]] = []
        self._formats: dict[torch.dtype, Any] = {}
        self._full = False                  # recorder_memory reached: no new slots
        self._params: dict[tuple, Any] = {}  # this iteration's parameter rows, by version
        self._host_params: dict[tuple, bytes] = {}   # ... their host slots' bytes
        self._kernel = OptionalModule(_load_cpu_kernel)   # the one-pass CPU statistics
        self._kernel_now: Any = False   # ... once _cpu_kernel decided: the kernel or None
        self._known: dict[tuple[int, int | None], tuple] = {}   # (id(site), sample) -> _slot_of
        _LIVE.add(self)          # a run that ends on an error still writes its summaries

    # -- the hot path ---------------------------------------------------------------------------
    def capturing(self, iteration: int) -> bool:
        """Whether ``iteration`` is in a trigger's full-capture window."""
        return self.capture_from <= iteration <= self.capture_until

    def record(self, tensor: torch.Tensor, site: CaptureSite, iteration: int,
               sample: int | None) -> None:
        """Statistics of one selected tensor into its slot (no host sync for device tensors).
        The hot path, one Python frame for a CPU tensor (in a step every frame finds its code
        and data evicted by the tensor work between calls): a site object seen before
        (hooks._at's cache) finds its slot, format and bounds by identity; the whole slot is
        one C call (stats_cpu), a parameter's second sight in an iteration one memmove of the
        slot's bytes kept from its first."""
        if not self.block or self.block[-1] != iteration:
            self._begin(iteration)
        known = self._known.get((id(site), sample))
        if known is None or known[0] is not site:
            known = self._slot_of(tensor, site, sample)
            if known is None:
                return
        # a parameter is taken twice a step (forward and backward operand) unchanged: its row
        # once per version (``_version`` changes on any in-place update); the dtype stands for
        # the format (one judged format per dtype: _new_slot)
        key = ((tensor.data_ptr(), tensor._version, tensor.shape, tensor.dtype)
               if tensor.is_leaf and tensor.requires_grad else None)
        if not (tensor.is_cpu and self.host_path):
            self._record_device(tensor, known, key)
            return
        _, slot, fmt, up, fl = known
        book = self.book
        p = self._plane
        address = book.host_address(p, slot)
        if key is not None:
            done = self._host_params.get(key)
            if done is not None:
                ctypes.memmove(address, done, SLOT_BYTES)
                return
        kernel = self._kernel_now if self._kernel_now is not False else self._cpu_kernel()
        if kernel is None or not kernel.slot_into(tensor, up, fl, address):
            book.host[p, slot] = host_row(tensor, fmt)      # the torch passes
            book.count[p, slot] = tensor.numel()
            book.seen[p, slot] = True
        if key is not None:
            self._host_params[key] = ctypes.string_at(address, SLOT_BYTES)

    def _record_device(self, tensor: torch.Tensor, known: tuple, key: tuple | None) -> None:
        """A device tensor's row into the device buffer (no host sync), once per parameter
        version as on the host."""
        _, slot, fmt, _, _ = known
        book = self.book
        p = self._plane
        done = self._params.get(key) if key is not None else None
        row = device_row(tensor, fmt) if done is None else done
        book.device_buffer(tensor.device)[p, slot].copy_(row)
        book.on_dev[p, slot] = True
        if key is not None:
            self._params[key] = row
        book.count[p, slot] = tensor.numel()
        book.seen[p, slot] = True

    def _slot_of(self, tensor: torch.Tensor, site: CaptureSite, sample: int | None
                 ) -> tuple | None:
        """(site, slot, format, overflow and flush bounds) of (site, micro-batch), the slot
        made on first sight; remembered by the site object's identity when it is the object
        the slot was made with (the object is kept, so its id is not reused)."""
        book = self.book
        slot = book.slots.get((site, sample))
        made = slot is None
        if made:
            slot = self._new_slot(tensor, site, sample)
            if slot is None:
                return None
        fmt = book.sites[book.slot_site[slot]].fmt
        known = (site, slot, fmt, *bounds(fmt))
        if made:
            self._known[(id(site), sample)] = known
        return known

    def _cpu_kernel(self) -> Any:
        """The one-pass kernel (tensor_capture.stats_cpu), or None: not wanted (cpu_kernel
        False), or it does not build here (said once; the torch path gives the same rows)."""
        if not self.cpu_kernel:
            return None
        kernel = self._kernel.get()
        if kernel is None:
            self._warn("recorder-cpu-kernel", "tensor capture: recorder: CPU statistics take "
                       f"the slower torch path ({self._kernel.error})")
        self._kernel_now = kernel     # decided: the hot path asks no more
        return kernel

    def _begin(self, iteration: int) -> None:
        if len(self.block) >= self.config.recorder_every:   # a boundary was missed: keep going
            self._collect()
        self._params.clear()
        self._host_params.clear()
        self.block.append(iteration)
        self.losses.append(math.nan)
        self._plane = len(self.block) - 1

    def _new_slot(self, tensor: torch.Tensor, site: CaptureSite, sample: int | None) -> int | None:
        c = self.config
        if self._full or ring_bytes(len(self.book) + 1, c.recorder_window,
                                    c.recorder_every) > c.recorder_memory:
            self._full = True
            self._warn("recorder-memory", f"tensor capture: recorder_memory="
                       f"{human_bytes(c.recorder_memory)} holds {len(self.book)} site x "
                       "micro-batch slots; later sites are not recorded: raise recorder_memory "
                       "or select fewer tensors (layers, module_regex, tensor_names)")
            return None
        fmt = self._formats.get(tensor.dtype, False)
        if fmt is False:
            quant = c.quant_type if c.emulating else None
            fmt = self._formats[tensor.dtype] = judged_format(quant, tensor.dtype)
        info = {"quant_type": self._label(site, tensor.dtype), "fmt": fmt,
                "dtype": str(tensor.dtype), "shape": list(tensor.shape)}
        return self.book.new_slot(site, sample, info)

    # -- the step boundary --------------------------------------------------------------------------
    def end_iteration(self, iteration: int, losses: Any = None) -> bool:
        """After the schedule of ``iteration`` returned (``losses``: its per-micro-batch loss
        dicts on the last stage): when N iterations are buffered, move them to the host, judge,
        agree, and act on a trigger; summaries every K iterations. True when the run should
        stop here (recorder_stop_on_trigger, the triggered capture done; the recorder is then
        closed and the caller ends the run)."""
        if not self.block or self.block[-1] != iteration:
            self._begin(iteration)
        self.losses[-1] = loss_of(losses)
        if len(self.block) >= self.config.recorder_every:
            self._collect()
        if self._stop_after is not None and iteration >= self._stop_after:
            self.close()
            budget.announce(f"tensor capture: recorder: stopping after iteration {iteration} "
                            "(recorder_stop_on_trigger)")
            return True
        return False

    def _collect(self) -> None:
        entries = self.book.collect(self.block, self.losses)
        self.block, self.losses = [], []
        for entry in entries:
            self._summaries().add(self.book, entry)
        flagged = self.rules.judge(self.rules.seen(self.book, entries))
        trigger_it, fired = self.rules.agree(flagged)
        last = entries[-1].iteration if entries else None
        if fired and last is not None and not self.capturing(last):
            self._trigger(trigger_it, last, fired, flagged)
        if self._summaries().due():
            self._summaries().write()

    def _summaries(self) -> SummaryWriter:
        if self.summaries is None:
            self.summaries = SummaryWriter(self.out_dir, self._rank_info()["rank"],
                                           self.config.recorder_summary_every,
                                           self.config.recorder_full_iterations)
        return self.summaries

    def _trigger(self, iteration: int, last: int, kinds: list[str],
                 flagged: dict[int, dict[str, Any]], replay_here: bool = False) -> None:
        """Ring out, capture window open, record and replay file written, one line said."""
        c = self.config
        info = self._rank_info()
        rank = info["rank"]
        ring = list(self.book.ring)
        stamp = time.strftime("%Y%m%d_%H%M%S")
        write_ring(self.directory, rank, ring_records(self.book, ring, info, stamp,
                                                      c.quant_type if c.emulating else None))
        self.capture_from, self.capture_until = last + 1, last + c.recorder_trigger_iterations
        if c.recorder_stop_on_trigger:
            self._stop_after = self.capture_until
        self._summaries().write()                 # the summaries up to the trigger, on disk now
        details = {k: v for it in sorted(flagged) for k, v in flagged[it].items()}
        replay = (write_replay(self.out_dir, iteration, kinds, c, self.capture_until)
                  if rank == 0 or replay_here else
                  self.out_dir / schema.recorder_replay_name(iteration))
        record = {"iteration": iteration, "kinds": kinds, "rank": rank,
                  "ring": [ring[0].iteration, ring[-1].iteration] if ring else None,
                  "capture": None if replay_here else [self.capture_from, self.capture_until],
                  "details": details,
                  "replay": replay.name}
        append_trigger(self.out_dir, rank, record)
        self.triggers.append(record)
        where = details.get("nonfinite") or details.get(kinds[0]) or {}
        at = f" ({where.get('module_path')} {where.get('tensor_name')}, micro-batch " \
             f"{where.get('sample_idx')} on rank {rank})" if where.get("module_path") else ""
        announce = budget.announce if not replay_here else _say
        announce(
            f"tensor capture: recorder: trigger {'+'.join(kinds)} at iteration {iteration}{at}; "
            f"ring of iterations {record['ring'][0] if ring else '-'}.."
            f"{record['ring'][1] if ring else '-'} written to {self.directory}, capturing "
            f"iterations {self.capture_from}..{self.capture_until} in full; replay: {replay}")

    def dump_on_error(self, iteration: int, exc: BaseException) -> None:
        """The step of ``iteration`` raised (e.g. Megatron-LM's NaN check in its loss function):
        the buffer, this iteration's records so far included, goes into the ring, and the ring,
        a trigger record of kind ``error`` and a replay file are written by this rank alone (no
        agreement: the other ranks may be anywhere); the run then ends as it would."""
        try:
            if not self.block or self.block[-1] != iteration:
                self._begin(iteration)
            entries = self.book.collect(self.block, self.losses)
            self.block, self.losses = [], []
            for entry in entries:
                self._summaries().add(self.book, entry)
            # the first iteration with a non-finite tensor, as the boundary would see it, and
            # the error on its own iteration
            first = next((e for e in entries if self.book.first_nonfinite(e) is not None), None)
            seen = {} if first is None else {
                first.iteration: Seen(first.iteration, stats=(self.book, first), loss=first.loss)}
            seen.setdefault(iteration, Seen(iteration)).error = (
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
            flagged = self.rules.judge(seen)
            self._trigger(iteration, iteration, rank_alone(flagged.get(iteration, {})), flagged,
                          replay_here=True)
            self.close()
        except Exception as inner:  # never hide the step's own error behind ours
            self._warn("recorder-error", f"tensor capture: recorder: could not write the ring "
                       f"after the step's error ({type(inner).__name__}: {inner})")

    def close(self) -> None:
        """Write what the buffer and the summaries still hold (end of the run)."""
        if self.block and any(self.book.seen[: len(self.block)].ravel()):
            entries = self.book.collect(self.block, self.losses)
            self.block, self.losses = [], []
            for entry in entries:
                self._summaries().add(self.book, entry)
        if self.summaries is not None:
            self.summaries.write()
        self.rules.signal.restore()
        _LIVE.discard(self)


def _load_cpu_kernel() -> Any:
    from .. import stats_cpu

    return stats_cpu.load()


def _say(line: str) -> None:
    """One line on this rank's stderr (a rank's own event: the others may not get there)."""
    print(line, file=sys.stderr, flush=True)


_LIVE: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for rec in list(_LIVE):
        try:
            rec.close()
        except Exception:  # exiting: never raise from atexit
            pass


atexit.register(_close_all_at_exit)


def loss_of(losses: Any) -> float:
    """The iteration's loss from a schedule's return value: the mean over micro-batches of each
    item's first value (a float, a tensor, Megatron-LM's ``{"lm loss": tensor}`` or its
    ``[sum, tokens]`` pair); NaN when there is none (not the last pipeline stage)."""
    values = []
    for item in losses or ():
        if isinstance(item, dict):
            item = next(iter(item.values()), None)
        if isinstance(item, torch.Tensor):
            flat = item.detach().float().reshape(-1).cpu()
            if flat.numel() == 2:                 # Megatron-LM: (loss sum, token count)
                item = float(flat[0] / flat[1]) if float(flat[1]) else math.nan
            elif flat.numel():
                item = float(flat[0])
            else:
                continue
        if isinstance(item, (int, float)):
            values.append(float(item))
    return sum(values) / len(values) if values else math.nan


# -- what a training loop tells the recorder --------------------------------------------------------
def report(grad_norm: float | None = None) -> None:
    """The training loop's gradient norm of the iteration whose schedule just returned (judged
    at the next step boundary, as a flag of that iteration). A no-op without a recorder."""
    saver = STATE.saver
    rec = getattr(saver, "recorder", None)
    if rec is not None and grad_norm is not None:
        rec.rules.grad_norms.append((saver.iteration, float(grad_norm)))


def set_run_info(**fields: Any) -> None:
    """How this run can be resumed (tensor_capture.recorder.replay.RunInfo's fields): the
    training loop's replay command builder and its checkpoints. Kept for the session."""
    info = STATE.session(RunInfo)
    for key, value in fields.items():
        if not hasattr(info, key):
            raise TypeError(f"set_run_info: unknown field {key!r}")
        setattr(info, key, value)


def start_line(config: CaptureConfig) -> str:
    """The recorder's start line (budget.announce_start in recorder mode)."""
    c = config
    return (f"tensor capture: flight recorder on -> {c.save_dir}: statistics of every selected "
            f"tensor, a ring of {c.recorder_window} iteration(s) (at most "
            f"{human_bytes(c.recorder_memory)}), summaries every {c.recorder_summary_every} "
            f"iteration(s) in {Path(c.save_dir) / schema.RECORDER_DIR}; a trigger "
            f"({', '.join(agreed_kinds())}; touch {Path(c.save_dir) / schema.RECORDER_TRIGGER_FILE} "
            f"to ask) captures {c.recorder_trigger_iterations} iteration(s) in full"
            + ("; then the run stops" if c.recorder_stop_on_trigger else ""))

