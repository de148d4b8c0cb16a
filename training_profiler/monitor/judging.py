"""The judging of ``@watch_training``: one :class:`Signal` row per watched signal, in
:data:`SIGNALS`, and the loop that reads and judges them for one synced step.

Why a table: each signal is a reader (how its value comes out of a step's synced numbers), a
threshold (non-finite, or the keywords of its :class:`AdaptiveThreshold`), a history field, an
alert note, the layer tensor its alerts name and its cadence. :func:`judge_step` knows none
of them by name, so a new signal is one row here and nothing else.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from training_profiler.monitor.sinks import fmt_number as _fmt
from training_profiler.monitor.state import (
    ABSMAX,
    KINDS,
    MEANABS,
    OVERFLOW,
    UNDERFLOW,
    MonitorState,
)
from training_profiler.monitor.thresholds import AdaptiveThreshold


class TrainingMonitor(Protocol):
    """What judging reads of ``adaptive_monitor.TrainingMonitor`` (a Protocol, so that the
    judging table does not import the monitor that runs it)."""

    layers: list[str]
    state: MonitorState
    thresholds: dict[str, AdaptiveThreshold]
    th_layer_gnorm: AdaptiveThreshold

#: How alerts name the two watched tensors of a layer (keys: monitor_state.KINDS).
TENSOR_LABELS = {"act": "forward output", "grad": "output gradient"}


class _StepView:
    """One synced step's numbers, parsed once for the signals to read."""

    __slots__ = ("step", "row", "loss", "gnorm", "layer_norms", "has_layers", "iteration")

    def __init__(self, monitor: TrainingMonitor, step: int, row: dict[str, Any]) -> None:
        self.step, self.row = step, row
        self.loss = float(row["loss"])
        self.iteration: int | None = row.get("iteration")
        # None: no gradient norm can exist (no model, none given); < 0: not measured this step
        # or no gradients
        self.gnorm: float | None = None
        self.layer_norms: np.ndarray | None = None
        state = monitor.state
        self.has_layers = state.model is not None   # per-layer data possible
        g = row.get("gnorm")
        if g is not None:
            self.gnorm = float(g[0])
            n_layers = len(state.layers)
            norms = g[1:1 + n_layers]
            if self.has_layers and len(norms) == n_layers > 0 and (norms >= 0).all():
                self.layer_norms = norms

    def stats(self, monitor: TrainingMonitor, kind: str) -> np.ndarray | None:
        """The per-layer rows of ``kind`` ("act" / "grad"): absmax, overflow ratio, underflow
        ratio, mean|x|; None when not taken this step."""
        st = self.row.get("stats")
        if not self.has_layers or st is None:
            return None
        return st[KINDS.index(kind)]


@dataclass(frozen=True)
class Signal:
    """One watched signal: how its value is read, how it is judged, what its alert says.

    ``threshold`` None: the value alarms when non-finite (no baseline needed); else the keyword
    arguments of its AdaptiveThreshold (per-layer signals warm up at the statistics cadence).
    ``read(monitor, view)`` returns the value (a float, or an array over the watched layers
    when ``per_layer``) or None when the step has no data for it. ``record``: the history key
    of ``summary(monitor, threshold, value)`` (default: the value itself; None: not recorded).
    ``note``: the alert's note, text or ``note(monitor, view, threshold, value)``.
    """

    name: str
    read: Callable[[TrainingMonitor, _StepView], Any]
    threshold: dict[str, Any] | None = None
    per_layer: bool = False
    record: str | None = None
    summary: Callable[[TrainingMonitor, AdaptiveThreshold, Any], Any] | None = None
    note: str | Callable[..., str] = ""
    alerts: bool = True
    #: per-layer signals: which tensor of the layer crossed (a key of TENSOR_LABELS)
    tensor: str | None = None
    #: how often the value exists: "step", "stats" (layer_stats_every), "grad_norm"
    cadence: str = "step"


def _nanmax_or_nan(_m: Any, _th: Any, v: np.ndarray) -> float:
    return float(np.nanmax(v)) if np.isfinite(v).any() else float("nan")


def _distortion_max(_m: Any, th: AdaptiveThreshold, scale: np.ndarray) -> float | None:
    if not th.ready:
        return None
    mean, _ = th.reference()
    with np.errstate(all="ignore"):
        shift = np.abs(scale - mean)
    return float(np.nanmax(shift)) if np.isfinite(shift).any() else 0.0


def _act_scale(m: TrainingMonitor, v: _StepView) -> np.ndarray | None:
    """Each layer's activation scale, log2 mean|x| (binades); NaN where undefined."""
    act = v.stats(m, "act")
    if act is None:
        return None
    with np.errstate(all="ignore"):
        scale = np.log2(act[:, MEANABS])
    return np.where(np.isfinite(scale), scale, np.nan)


def _grad_norm_note(m: TrainingMonitor, v: _StepView, th: AdaptiveThreshold, value: float) -> str:
    note = why(th, value)
    z = m.th_layer_gnorm.last_z
    if v.layer_norms is not None and z is not None and len(z) and np.isfinite(z).any():
        note += f"; largest layer jump: '{m.layers[int(np.nanargmax(z))]}'"
    return note


def _absmax(kind: str) -> Callable[[TrainingMonitor, _StepView], Any]:
    def read(m: TrainingMonitor, v: _StepView) -> np.ndarray | None:
        stats = v.stats(m, kind)
        return None if stats is None else stats[:, ABSMAX]
    return read


def _ratios(kind: str, col: int) -> Callable[[TrainingMonitor, _StepView], Any]:
    def read(m: TrainingMonitor, v: _StepView) -> np.ndarray | None:
        stats = v.stats(m, kind)
        return None if stats is None else stats[:, col]
    return read


def _range_signals(kind: str, what: str, order: str) -> tuple[Signal, ...]:
    """A kind's non-finite check and its overflow / underflow ratio signals."""
    ratio = dict(direction="up", range_check=False, rel_floor=0.5, abs_floor=1e-4)
    return (Signal(f"{kind}_nonfinite", _absmax(kind), per_layer=True, tensor=kind,
                   cadence="stats",
                   note=f"non-finite {what} (first watched layer in {order} order)"),) + tuple(
        Signal(f"{kind}_{name}_ratio", _ratios(kind, col), ratio, per_layer=True, tensor=kind,
               cadence="stats", record=f"{kind}_{name}_ratio_max", summary=_nanmax_or_nan)
        for name, col in (("overflow", OVERFLOW), ("underflow", UNDERFLOW)))


#: Every signal the monitor judges, in the order its alerts and history fields appear.
SIGNALS: tuple[Signal, ...] = (
    Signal("loss_nonfinite", lambda m, v: v.loss, note="non-finite loss"),
    Signal("loss", lambda m, v: v.loss, dict(direction="up"),
           note=lambda m, v, th, x: why(th, x)),
    Signal("grad_norm_nonfinite", lambda m, v: None if v.gnorm is None or v.gnorm < 0 else v.gnorm,
           note="non-finite gradient norm"),
    # before grad_norm: its alert names the layer whose norm jumped most this step
    Signal("layer_grad_norm", lambda m, v: v.layer_norms, dict(direction="up", range_check=False),
           per_layer=True, alerts=False, cadence="stats"),
    Signal("grad_norm", lambda m, v: None if v.gnorm is None else (math.nan if v.gnorm < 0 else v.gnorm),
           dict(direction="up"), record="grad_norm", note=_grad_norm_note, cadence="grad_norm"),
    *_range_signals("act", "activations", "forward"),
    *_range_signals("grad", "output gradients", "module"),
    Signal("distortion", _act_scale,
           dict(direction="both", range_check=False, rel_floor=0.0, abs_floor=0.25),
           per_layer=True, record="distortion_max_binades", summary=_distortion_max, tensor="act",
           cadence="stats", note="activation scale (log2 mean|x|) shifted from its baseline"),
)




def why(th: AdaptiveThreshold, value: float) -> str:
    """Which test a scalar alert failed: the doubled warm-up range, or the sigma test."""
    assert th.baseline is not None
    if th.range_check and th.baseline["max"][0] > 0 and value > 2 * th.baseline["max"][0]:
        return f"above 2x the warm-up max {_fmt(float(th.baseline['max'][0]))}"
    return f"beyond {th.sigma:g}σ"


def judge_step(monitor: TrainingMonitor, step: int,
               row: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], bool]:
    """Read and judge every signal of SIGNALS for one step, in table order. Returns the
    metrics record, the alerts, and whether a non-finite value alarmed."""
    view = _StepView(monitor, step, row)
    rec: dict[str, Any] = {"kind": "metrics", "step": step, "loss": view.loss}
    alerts: list[dict[str, Any]] = []
    nonfinite = False
    for sig in SIGNALS:
        value = sig.read(monitor, view)
        if value is None:
            continue
        if sig.threshold is None:
            nonfinite |= _judge_nonfinite(monitor, sig, view, value, alerts)
        else:
            _judge_adaptive(monitor, sig, view, value, rec, alerts)
    return rec, alerts, nonfinite


def _note(monitor: TrainingMonitor, sig: Signal, view: _StepView,
          th: AdaptiveThreshold | None, value: float) -> str:
    return sig.note if isinstance(sig.note, str) else sig.note(monitor, view, th, value)


def _judge_nonfinite(monitor: TrainingMonitor, sig: Signal, view: _StepView, value: Any,
                     alerts: list[dict[str, Any]]) -> bool:
    """Non-finite values need no baseline; per layer, the first such layer is named."""
    if sig.per_layer:
        bad = ~np.isfinite(value)
        if not bad.any():
            return False
        i = int(np.argmax(bad))
        value = float(value[i])
    elif math.isfinite(value):
        return False
    else:
        i = 0
    alerts.append(_alert(monitor, view, sig, value, None, idx=i,
                         note=_note(monitor, sig, view, None, value)))
    return True


def _judge_adaptive(monitor: TrainingMonitor, sig: Signal, view: _StepView, value: Any,
                    rec: dict[str, Any], alerts: list[dict[str, Any]]) -> None:
    th = monitor.thresholds[sig.name]
    if sig.per_layer:
        bad = th.update(value)
    else:   # a scalar teaches its baseline only finite values (its non-finite signal alarms)
        bad = th.update(value) if math.isfinite(value) else None
    if sig.record is not None:
        summary = value if sig.summary is None else sig.summary(monitor, th, value)
        if summary is not None:
            rec[sig.record] = summary
    if not sig.alerts or bad is None:
        return
    for i in np.flatnonzero(bad):
        v = float(value[i]) if sig.per_layer else value
        alerts.append(_alert(monitor, view, sig, v, th, idx=int(i),
                             note=_note(monitor, sig, view, th, v)))


def _alert(monitor: TrainingMonitor, view: _StepView, sig: Signal, value: float,
           th: AdaptiveThreshold | None, idx: int = 0, note: str = "") -> dict[str, Any]:
    """One alert record; a per-layer one names the layer and the tensor that crossed, and
    points at the captured files of that layer and iteration when capture saved them."""
    step, metric = view.step, sig.name
    layer = monitor.layers[idx] if sig.per_layer else None
    tensor = TENSOR_LABELS[sig.tensor] if layer is not None and sig.tensor else None
    msg = f"[ALERT] Step {step} | "
    if layer is not None:
        msg += f"Layer '{layer}' " + (f"{tensor} " if tensor else "")
    msg += f"{metric}: {_fmt(value)}"
    base_mean = base_std = dev = None
    if th is not None and th.ready:
        mean, std = th.reference()
        base_mean, base_std = float(mean[idx]), float(std[idx])
        dev = float(th.last_z[idx]) if th.last_z is not None else None
        msg += f" (baseline: {_fmt(base_mean)}±{_fmt(base_std)})"
        if dev is not None and math.isfinite(dev):
            msg += f" | Deviation: {dev:.1f}σ"
    if note:
        msg += f" | {note}"
    capture = monitor.state.capture_link(idx, view.iteration) if layer is not None else None
    if capture is not None:
        msg += f" | capture: {capture['dir']}/{capture['glob']} (iteration {capture['iteration']})"
    return {"kind": "alert", "step": step, "metric": metric, "value": value,
            "layer": layer, "tensor": tensor, "baseline_mean": base_mean,
            "baseline_std": base_std, "deviation": dev, "iteration": view.iteration,
            "capture": capture, "message": msg}
