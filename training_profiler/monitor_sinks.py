"""Where ``@watch_training`` sends its lines and numbers: stdout, logging, JSON Lines, TensorBoard.

A sink gets every record as a dict (``kind`` is "status", "alert" or "metrics"); text sinks use
the record's ``message``. Sinks are picked by spec strings so the decorator stays one line:
``"stdout"``, ``"logging"``, ``"jsonl:run/monitor.jsonl"``, ``"tensorboard:run/tb"``.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from typing import Any, Protocol

from lowp_common import json_dumps


class Sink(Protocol):
    def emit(self, record: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class StdoutSink:
    def __init__(self, stream=None) -> None:
        self.stream = stream

    def emit(self, record: dict[str, Any]) -> None:
        if record["kind"] in ("status", "alert", "info"):
            print(record["message"], file=self.stream or sys.stdout)

    def flush(self) -> None:
        (self.stream or sys.stdout).flush()

    def close(self) -> None:
        self.flush()


class LoggingSink:
    """Status lines at INFO, alerts at WARNING, on logger ``training_profiler.monitor``."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger("training_profiler.monitor")

    def emit(self, record: dict[str, Any]) -> None:
        if record["kind"] == "alert":
            self.logger.warning(record["message"])
        elif record["kind"] in ("status", "info"):
            self.logger.info(record["message"])

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object a line; appended, flushed at every monitor sync."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = os.fspath(path)
        self._fh = open(self.path, "a", encoding="utf-8")

    def emit(self, record: dict[str, Any]) -> None:
        self._fh.write(json_dumps(record) + "\n")  # NaN/Inf as strings: every line valid JSON

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


class TensorBoardSink:
    """Scalars of "metrics" records and alert texts; needs the optional tensorboard package."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is optional
            raise ValueError(f"tensorboard sink needs the tensorboard package "
                             f"(pip install tensorboard): {exc}") from None
        self.writer = SummaryWriter(log_dir=os.fspath(log_dir))

    def emit(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        if record["kind"] == "metrics":
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"monitor/{key}", value, step)
        elif record["kind"] == "alert":
            self.writer.add_text("monitor/alerts", record["message"], step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def make_sink(spec: "str | Sink") -> Sink:
    """A sink from a spec string ('stdout', 'logging', 'jsonl:PATH', 'tensorboard:DIR') or as is."""
    if not isinstance(spec, str):
        return spec
    kind, _, arg = spec.partition(":")
    if kind == "stdout":
        return StdoutSink()
    if kind == "logging":
        return LoggingSink()
    if kind == "jsonl" and arg:
        return JsonlSink(arg)
    if kind == "tensorboard" and arg:
        return TensorBoardSink(arg)
    raise ValueError(f"unknown monitor sink {spec!r}; use 'stdout', 'logging', 'jsonl:PATH' or 'tensorboard:DIR'")
