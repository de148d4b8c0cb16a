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
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from lowp_common import json_dumps

if TYPE_CHECKING:
    from training_profiler.monitor.thresholds import AdaptiveThreshold


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


def fmt_number(x: float) -> str:
    """A number as the monitor's lines show it: 4 significant digits, NaN/inf spelled out."""
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


def _status_part(name: str, value: float, th: AdaptiveThreshold) -> str:
    if th.ready:
        mean, std = th.reference()
        return (f"{name}: {fmt_number(value)} "
                f"(baseline: {fmt_number(float(mean[0]))}±{fmt_number(float(std[0]))})")
    return f"{name}: {fmt_number(value)}"


class MonitorOutput:
    """What a judged step leaves behind: the history, the alerts (a repeat of the same metric
    and layer within ``cooldown`` steps is kept but not printed), the baseline notice and the
    status lines, sent to every sink and to ``on_alert``."""

    def __init__(self, sinks: Iterable[str | Sink], on_alert: Callable[[dict[str, Any]], None] | None,
                 cooldown: int, log_every: int, warmup_steps: int) -> None:
        self.sinks: list[Sink] = [make_sink(s) for s in sinks]
        self.on_alert = on_alert
        self.cooldown, self.log_every, self.warmup_steps = cooldown, log_every, warmup_steps
        self._last_emitted: dict[tuple[str, str | None], int] = {}
        self.suppressed_alerts = 0
        self.alerts: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []  # per-step scalars (numbers only)

    def publish(self, step: int, loss: float, rec: dict[str, Any], alerts: list[dict[str, Any]],
                th_loss: AdaptiveThreshold, th_gnorm: AdaptiveThreshold) -> None:
        """History, sinks, the baseline notice, alerts (with their cool-down) and the status line."""
        self.history.append({k: v for k, v in rec.items() if k != "kind"})
        self.emit(rec)
        if step == self.warmup_steps and th_loss.ready:
            mean, std = th_loss.reference()
            self.emit({"kind": "info", "step": step, "message":
                       f"[Monitor] Baseline established at step {step}: loss "
                       f"{fmt_number(mean[0])}±{fmt_number(std[0])}"
                       + (f", grad_norm {fmt_number(th_gnorm.reference()[0][0])}±"
                          f"{fmt_number(th_gnorm.reference()[1][0])}" if th_gnorm.ready else "")})
        for a in alerts:
            self._alert(step, a)
        if step % self.log_every == 0:
            parts = [f"[Monitor] Step {step}", _status_part("loss", loss, th_loss)]
            if "grad_norm" in rec:
                parts.append(_status_part("grad_norm", rec["grad_norm"], th_gnorm))
            parts.append("Status: " + ("ALERT" if alerts else ("WARMUP" if not th_loss.ready else "OK")))
            self.emit({"kind": "status", "step": step, "message": " | ".join(parts)})

    def _alert(self, step: int, a: dict[str, Any]) -> None:
        self.alerts.append(a)
        key = (a["metric"], a["layer"])
        last = self._last_emitted.get(key)
        self._last_emitted[key] = step
        if last is not None and step - last <= self.cooldown:
            self.suppressed_alerts += 1   # the same problem again within the cool-down
            return
        self.emit(a)
        if self.on_alert:
            self.on_alert(a)

    def emit(self, rec: dict[str, Any]) -> None:
        for s in self.sinks:
            s.emit(rec)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def close(self) -> None:
        for s in self.sinks:
            s.close()
