"""Writer management of one TensorSaver: the directory, the background writer, disk errors.

Why its own module: a capture must never stop training, so an unwritable directory or a
full disk turns saving off with one message (and tells the owner through ``on_failure``);
the writer thread and its bounded queue start only when the first record arrives. What a
record holds is tensor_capture.record's job; the thread itself is tensor_capture.writer.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from .writer import BackgroundWriter, WriteItem


class CaptureSink:
    """Where records go: ``directory`` through a lazily started BackgroundWriter."""

    def __init__(self, directory: str | os.PathLike[str], queue_size: int,
                 on_failure: Callable[[], None] | None = None,
                 on_record: Callable[[dict[str, Any]], None] | None = None):
        self.directory = Path(directory)
        self._on_record = on_record
        self.queue_size = queue_size
        self.failed: str | None = None
        self._on_failure = on_failure
        self._writer: BackgroundWriter | None = None
        self._dir_ready = False
        self._lock = threading.Lock()

    def prepare_dir(self) -> bool:
        """Create the directory and probe that a file can be written there (once)."""
        if self._dir_ready:
            return True
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".write_probe_{os.getpid()}"
            with open(probe, "wb") as fh:
                fh.write(b"0")
            probe.unlink()
        except OSError as exc:
            self.fail(f"tensor capture: cannot write to {self.directory} "
                      f"({exc.strerror or exc}); saving is disabled, training continues. "
                      "Fix: set TENSOR_SAVE_DIR to a writable directory.")
            return False
        self._dir_ready = True
        return True

    def writer(self) -> BackgroundWriter | None:
        """The writer, started on first use; None when the directory is unusable."""
        if self._writer is None:
            with self._lock:
                if self._writer is None:
                    if not self.prepare_dir():
                        return None
                    self._writer = BackgroundWriter(self.queue_size, on_error=self.fail,
                                                   on_record=self._on_record)
        return self._writer

    def submit(self, item: WriteItem) -> bool:
        """Queue a record; False when saving has failed (nothing will be written)."""
        writer = self.writer()
        return writer is not None and writer.submit(item)

    def fail(self, message: str) -> None:
        """Saving is off from now on: say why once, tell the owner."""
        if self.failed is None:
            self.failed = message
            print(message, file=sys.stderr, flush=True)
            if self._on_failure is not None:
                self._on_failure()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
