"""What-if numerics as TensorBoard scalars and histograms, beside the run's loss curves.

Why: a researcher watching a long run looks at TensorBoard, not at a report drawn afterwards;
per-layer SQNR and overflow / underflow / flush ratios of each what-if format over iterations
and the MX / NVFP4 block-scale histograms belong next to the loss. The writer thread calls
:meth:`NumericsBoard.log` with each finished manifest record (metadata key
``schema.META_WHATIF``), so training never waits for it.

Where the events go, first found wins: the capture setting ``tensorboard_dir``
(``TENSOR_SAVE_TENSORBOARD_DIR``), Megatron-LM's ``--tensorboard-dir`` (read from
``megatron.training``'s parsed arguments when that module is loaded), none (nothing written).
Our own training driver exports its ``--tensorboard-dir`` as ``TENSOR_SAVE_TENSORBOARD_DIR``.

Tags (one tag per layer x tensor; ``rank{r}/`` in front when the world has more than one rank):
``whatif/<format>/<metric>/<key>`` for metric in :data:`SCALARS`, and
``block_scale/<format>/<key>`` histograms (MX: the E8M0 exponent; NVFP4: log2 of the E4M3
scale); ``<key>`` is ``L<layer>.<submodule>.<operation>.<tensor>`` (``LNA`` for no layer).
The step is the iteration; the first micro-batch of an iteration is logged, the others skipped.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

from quant.whatif_record import SCALAR_KEYS

from . import schema

#: what-if metrics written as scalars (quant.whatif's keys)
SCALARS = SCALAR_KEYS
#: the events file's suffix, so ours are told from Megatron's in the same folder
FILE_SUFFIX = ".tensor_numerics"


def megatron_tensorboard_dir() -> str | None:
    """Megatron-LM's ``--tensorboard-dir`` when ``megatron.training`` has parsed its arguments
    (never imports it: a megatron-core-only process has none)."""
    gv = sys.modules.get("megatron.training.global_vars")
    args = getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None
    value = getattr(args, "tensorboard_dir", None)
    return str(value) if value else None


def resolve_dir(configured: str | None) -> str | None:
    """The folder events go to (module docstring's order), or None."""
    return configured or megatron_tensorboard_dir()


def tag_key(record: dict[str, Any]) -> str:
    """``L<layer>.<submodule>.<operation>.<tensor>`` of a manifest record."""
    layer = record.get("layer_idx")
    where = record.get(schema.META_SUBMODULE) or record.get("layer_type") or "?"
    return (f"L{'NA' if layer is None else layer}.{where}."
            f"{record.get('operation')}.{record.get('tensor_name')}")


class NumericsBoard:
    """Writes what-if numerics of manifest records to TensorBoard (module docstring).

    ``directory``: None means "resolve on the first record" (Megatron's arguments are parsed
    after capture is configured). Failures never reach training: one line, then off.
    """

    def __init__(self, directory: str | None, say: Callable[[str], None] | None = None):
        self._configured = directory
        self._writer: Any = None
        self._off = False
        self._seen: dict[str, int] = {}
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self.directory: str | None = None

    def _open(self) -> Any:
        if self._writer is None and not self._off:
            self.directory = resolve_dir(self._configured)
            if self.directory is None:
                self._off = True
                return None
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._disable("tensorboard is not installed (pip install tensorboard)")
                return None
            os.makedirs(self.directory, exist_ok=True)
            self._writer = SummaryWriter(log_dir=self.directory, filename_suffix=FILE_SUFFIX)
        return self._writer

    def _disable(self, why: str) -> None:
        self._off = True
        self._say(f"tensor capture: no what-if numerics in TensorBoard: {why}")

    def log(self, record: dict[str, Any]) -> None:
        """Write one record's what-if numerics (no-op for a record without them)."""
        whatif = record.get(schema.META_WHATIF)
        if not isinstance(whatif, dict) or self._off:
            return
        with self._lock:
            try:
                self._log(record, whatif)
            except Exception as exc:
                self._disable(f"{type(exc).__name__}: {exc}")

    def _log(self, record: dict[str, Any], whatif: dict[str, Any]) -> None:
        key = tag_key(record)
        if (record.get(schema.META_WORLD_SIZE) or 1) > 1:
            key = f"rank{record.get('rank')}/{key}"
        step = int(record.get("iteration") or 0)
        if self._seen.get(key, -1) >= step:      # a later micro-batch of a logged iteration
            return
        writer = self._open()
        if writer is None:
            return
        self._seen[key] = step
        for fmt, numbers in (whatif.get(schema.WHATIF_FORMATS) or {}).items():
            if not isinstance(numbers, dict) or "error" in numbers:
                continue
            for metric in SCALARS:
                value = numbers.get(metric)
                if isinstance(value, (int, float)):
                    writer.add_scalar(f"whatif/{fmt}/{metric}/{key}", float(value), step)
            scale = numbers.get("block_scale")
            if isinstance(scale, dict):
                _histogram(writer, f"block_scale/{fmt}/{key}", scale.get("hist") or {}, step)

    def flush(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.flush()

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def _histogram(writer: Any, tag: str, hist: dict[str, Any], step: int) -> None:
    """An integer histogram ``{"min_bin", "counts"}`` as a TensorBoard histogram: one bucket
    per integer bin ``[b - 0.5, b + 0.5)``."""
    counts, lo = hist.get("counts") or [], hist.get("min_bin")
    if lo is None or not counts or sum(counts) == 0:
        return
    bins = [lo + i for i in range(len(counts))]
    n = sum(counts)
    total = sum(b * c for b, c in zip(bins, counts))
    squares = sum(b * b * c for b, c in zip(bins, counts))
    used = [b for b, c in zip(bins, counts) if c]
    writer.add_histogram_raw(tag, min=min(used), max=max(used), num=n, sum=total,
                             sum_squares=squares, bucket_limits=[b + 0.5 for b in bins],
                             bucket_counts=counts, global_step=step)
