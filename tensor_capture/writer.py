"""Background writer: a bounded queue drained by one thread; atomic files; flush on exit.

Why a thread: torch.save of a large tensor takes milliseconds to seconds; the training
step must not wait for the disk. The queue is bounded so a slow disk applies back-pressure
instead of exhausting host memory. Each file is written under a temporary name in the
same directory and renamed (os.replace), so a crash never leaves a half-written ``.pt``;
the manifest line is appended only after the rename.
"""
from __future__ import annotations

import atexit
import queue
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from lowp_common import atomic_path

from . import schema, stats, whatif


@dataclass
class WriteItem:
    """One captured tensor on its way to disk (tensor and stats already on the host)."""

    directory: Path
    rank: int | None
    filename: str | None            # None: stats only
    tensor: torch.Tensor | None
    stats_vec: torch.Tensor | None  # None: compute from stats_src here
    ranges: Sequence[stats.RangeSpec]
    metadata: dict[str, Any]
    event: Any = None               # CUDA event recorded after the device-to-host copies
    done: Callable[[], None] | None = field(default=None, repr=False)
    stats_src: torch.Tensor | None = field(default=None, repr=False)   # host copy, whole tensor
    whatif: whatif.WhatifJob | None = None   # what-if numerics to compute here
    whatif_src: torch.Tensor | None = field(default=None, repr=False)   # staged for it


_STOP = object()
#: at most this many records per manifest write: the writer appends the records it finished
#: since its queue was last empty in one write (an open, write and close cost ~35 us per record
#: here, a tenth of a stats-only record's writer time at small widths)
MANIFEST_BATCH = 256
_LIVE: "weakref.WeakSet[BackgroundWriter]" = weakref.WeakSet()


def _flush_all_at_exit() -> None:
    for w in list(_LIVE):
        try:
            w.close()
        except Exception:  # exiting: never raise from atexit
            pass


atexit.register(_flush_all_at_exit)


class BackgroundWriter:
    """Writes WriteItems in submission order on a daemon thread."""

    def __init__(self, queue_size: int = 64, on_error: Callable[[str], None] | None = None,
                 on_record: Callable[[dict[str, Any]], None] | None = None):
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max(1, queue_size))
        self._on_error = on_error
        self._on_record = on_record     # told each record once it is in the manifest
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._run, name="tensor-capture-writer", daemon=True)
        self._closed = False
        self._thread.start()
        _LIVE.add(self)

    def submit(self, item: WriteItem) -> bool:
        """Queue an item (blocks while the queue is full). False once writing has failed."""
        if self.failed or self._closed:
            return False
        self._q.put(item)
        return True

    def flush(self) -> None:
        """Wait until everything submitted so far is on disk."""
        if self._thread.is_alive():
            self._q.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._q.put(_STOP)
            self._thread.join()
        _LIVE.discard(self)

    # -- worker ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            items = [self._q.get()]
            while items[-1] is not _STOP and len(items) < MANIFEST_BATCH:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            finished: list[tuple[WriteItem, dict[str, Any]]] = []
            for item in items:
                if item is _STOP:
                    break
                try:
                    if not self.failed:
                        finished.append((item, self._write(item)))
                except Exception as exc:  # disk errors, and bugs: neither may kill training
                    self._fail(item, exc)
            try:
                self._publish(finished)
            except Exception as exc:
                if not self.failed:             # said once, as for the files
                    self._fail(finished[0][0], exc)
            for _ in items:
                self._q.task_done()
            if items[-1] is _STOP:
                return

    def _fail(self, item: WriteItem, exc: BaseException) -> None:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        if isinstance(exc, OSError):
            self.failed = (f"tensor capture: cannot write to {item.directory} ({reason}); "
                           "saving is now disabled, training continues. Fix: point "
                           "TENSOR_SAVE_DIR at a writable directory with free space.")
        else:
            self.failed = (f"tensor capture: internal error writing {item.filename or 'a record'} "
                           f"({type(exc).__name__}: {reason}); saving is now disabled, training "
                           "continues. Please report this with the message.")
        if self._on_error is not None:
            self._on_error(self.failed)
        else:
            print(self.failed, file=sys.stderr)

    def _write(self, item: WriteItem) -> dict[str, Any]:
        """The item's files and its manifest record (appended by :meth:`_publish`)."""
        if item.event is not None:
            item.event.synchronize()
        meta = dict(item.metadata)
        vec = item.stats_vec
        if item.whatif is not None:
            meta[schema.META_WHATIF] = item.whatif.run(item.stats_src)
            item.whatif = None
        if vec is None:
            vec = stats.compute(item.stats_src, item.ranges)
        item.stats_src = None
        meta[schema.META_STATS] = stats.decode(vec, item.ranges)
        if item.filename is not None and item.tensor is not None:
            with atomic_path(item.directory / item.filename) as tmp:
                torch.save({"tensor": item.tensor, "metadata": meta}, tmp)
        record = dict(meta)
        record[schema.MANIFEST_FILE] = item.filename if item.tensor is not None else None
        return record

    def _publish(self, finished: list[tuple[WriteItem, dict[str, Any]]]) -> None:
        """Append the finished records to their manifests, one write per manifest (their
        files are already in place), then tell the owner and the items, in submission order."""
        by_manifest: dict[tuple[Path, int | None], list[dict[str, Any]]] = {}
        for item, record in finished:
            by_manifest.setdefault((item.directory, item.rank), []).append(record)
        for (directory, rank), records in by_manifest.items():
            schema.append_manifest(directory, rank, *records)
        for item, record in finished:
            if self._on_record is not None:
                self._on_record(record)
            if item.done is not None:
                item.done()
