"""P1: ``@watch_training`` — a training-step decorator with thresholds learnt from the run itself.

The monitor is four parts, one module each: what counts as anomalous and the learnt baselines
(``monitor_thresholds``: :class:`MonitorThresholds`, :class:`AdaptiveThreshold`), the device
buffers and hooks a step fills (``monitor_state``: :class:`MonitorCadence`, ``MonitorState``),
the signal table and its judging (``monitor_judging.SIGNALS``), and where lines and numbers go
(``monitor_sinks``). This module joins them: :class:`TrainingMonitor` runs a step through them
and :func:`watch_training` wraps a training step in one.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from typing import Any

import torch

from quant.analysis import dtype_limits as quant_dtype_limits
from training_profiler.monitor import judging as monitor_judging
from training_profiler.monitor.judging import SIGNALS, TENSOR_LABELS, Signal, judge_step
from training_profiler.monitor.sinks import MonitorOutput, Sink
from training_profiler.monitor.state import MonitorCadence, MonitorState, capture_iteration
from training_profiler.monitor.thresholds import AdaptiveThreshold, MonitorThresholds

__all__ = ["AdaptiveThreshold", "MonitorCadence", "MonitorThresholds", "SIGNALS", "Signal",
           "TENSOR_LABELS", "TrainingMonitor", "dtype_limits", "watch_training"]

_THRESHOLD_KEYS = frozenset(f.name for f in fields(MonitorThresholds))
_CADENCE_KEYS = frozenset(f.name for f in fields(MonitorCadence))


def dtype_limits(dtype: torch.dtype) -> tuple[float, float]:
    """(max finite, smallest normal) of a floating dtype, from quant.analysis.dtype_limits.

    Underflow here means a nonzero value below the smallest normal: it has entered the
    subnormal range (losing mantissa bits) or, one step further, flushes to zero.
    """
    lim = quant_dtype_limits(dtype)
    return lim.max_normal, lim.min_normal


def _loss_of(result: Any) -> Any:
    if isinstance(result, dict):
        return result.get("loss")
    if isinstance(result, (tuple, list)) and result:
        return result[0]
    return result


def _settings(thresholds: MonitorThresholds | None, cadence: MonitorCadence | None,
              settings: dict[str, Any]) -> tuple[MonitorThresholds, MonitorCadence]:
    """The two setting groups from the flat keywords (which override the groups given)."""
    unknown = sorted(set(settings) - _THRESHOLD_KEYS - _CADENCE_KEYS)
    if unknown:
        raise TypeError(f"TrainingMonitor() got unexpected keyword argument(s): "
                        f"{', '.join(unknown)}")
    cad = replace(cadence or MonitorCadence(),
                  **{k: v for k, v in settings.items() if k in _CADENCE_KEYS})
    th = replace(thresholds or MonitorThresholds(),
                 **{k: v for k, v in settings.items() if k in _THRESHOLD_KEYS})
    return th, cad


class TrainingMonitor:
    """The state behind ``@watch_training``; usable directly with ``step_end(loss, ...)``.

    Settings come as the fields of :class:`MonitorThresholds` (warmup_steps, alert_window,
    sigma, rolling, overflow_margin, watch_dtype, cooldown) and :class:`MonitorCadence`
    (log_every, sync_every, layer_stats_every, sample_size, grad_norm_every), either as
    keywords or as the frozen groups ``thresholds=`` / ``cadence=`` (keywords win).
    """

    def __init__(self, *, model: torch.nn.Module | None = None,
                 thresholds: MonitorThresholds | None = None, cadence: MonitorCadence | None = None,
                 sinks: Iterable[str | Sink] = ("stdout",),
                 layer_filter: Callable[[str, torch.nn.Module], bool] | None = None,
                 on_alert: Callable[[dict[str, Any]], None] | None = None, **settings: Any) -> None:
        th, cad = _settings(thresholds, cadence, settings)
        self.threshold_settings, self.cadence = th, cad
        # read on every step: plain attributes
        self.layer_stats_every, self.sync_every = cad.layer_stats_every, cad.sync_every
        self.grad_norm_every = cad.grad_norm_steps
        self.warmup_steps = th.warmup_steps
        self.output = MonitorOutput(sinks, on_alert, th.cooldown, cad.log_every, th.warmup_steps)
        self.sinks, self.alerts, self.history = self.output.sinks, self.output.alerts, self.output.history
        #: steps between two values of a signal, by its cadence (thresholds warm up and roll over
        #: proportionally fewer values)
        self._cadence = {"step": 1, "stats": cad.layer_stats_every,
                         "grad_norm": min(self.grad_norm_every, cad.layer_stats_every)}
        #: signal name -> its AdaptiveThreshold (one per adaptive signal of SIGNALS)
        self.thresholds: dict[str, AdaptiveThreshold] = {
            sig.name: self._new_threshold(sig) for sig in monitor_judging.SIGNALS
            if sig.threshold is not None}
        self.th_loss, self.th_layer_gnorm = self.thresholds["loss"], self.thresholds["layer_grad_norm"]
        self.state = MonitorState(cad, th, layer_filter)
        self._collect = cad.layer_stats_every == 1  # are the hooks recording during this step?
        self._grad_norm_given = False
        self.step = 0
        self._pending = 0
        self._nonfinite_seen = False
        if model is not None:
            self.attach(model)

    def __getattr__(self, name: str) -> Any:
        """A setting read as an attribute (``monitor.sigma``, ``monitor.sample_size``), as
        before the settings were grouped."""
        groups = [self.__dict__.get(g) for g in ("threshold_settings", "cadence")]
        for group in groups:
            if group is not None and name in group.__dataclass_fields__:
                return getattr(group, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def th_gnorm(self) -> AdaptiveThreshold:
        return self.thresholds["grad_norm"]

    @property
    def model(self) -> torch.nn.Module | None:
        return self.state.model

    @property
    def layers(self) -> list[str]:
        """The watched layers' names; per-layer alerts and arrays follow this order."""
        return self.state.layers

    @property
    def suppressed_alerts(self) -> int:
        return self.output.suppressed_alerts

    def _new_threshold(self, sig: Signal) -> AdaptiveThreshold:
        return self.threshold_settings.adaptive(self._cadence[sig.cadence], **(sig.threshold or {}))

    def attach(self, model: torch.nn.Module) -> None:
        """Choose the watched layers and preallocate the buffers (hooks go on per statistics step)."""
        self.state.attach(model)
        if self._collect:
            self.state.hooks_on()

    def detach(self) -> None:
        self.state.hooks_off()

    # ---- per step ------------------------------------------------------------------------
    def step_end(self, loss: Any, grad_norm: Any = None, iteration: int | None = None) -> None:
        """Record this step's loss, gradient norms and statistics (on device); judge every
        sync_every steps.

        ``grad_norm``: the global gradient norm when the training loop computed it (a tensor
        or a number; clip_grad_norm_'s return, Megatron's reported norm); then the monitor does
        not read the gradients for it. ``iteration``: the capture iteration of this step when
        the loop numbers it itself; else the process-wide capture saver's iteration is read.
        """
        st = self.state
        slot = self._pending
        st.put_loss(slot, loss)
        if grad_norm is not None:
            self._take_grad_norm(slot, grad_norm)
        measured = grad_norm is not None
        has_model = st.model is not None
        if has_model and (self._collect or (
                not measured and (self.step + 1) % self.grad_norm_every == 0)):
            st.grad_norms(slot, per_layer=self._collect, keep_global=measured)
            measured = True
        st.slot_gnorm[slot] = measured
        if self._collect and has_model:
            st.finish_stats(slot)
        st.slot_has_stats[slot] = self._collect and has_model
        st.slot_iteration[slot] = int(iteration) if iteration is not None else capture_iteration()
        self.step += 1
        self._pending += 1
        if self._pending == self.sync_every:
            self.sync()
        # Hooks record during the next step when it is a statistics step, or every step after a
        # non-finite loss was seen (to name the layer where it starts); they are installed only
        # then, so other steps run the model at full speed.
        self._collect = (self.step + 1) % self.layer_stats_every == 0 or self._nonfinite_seen
        if has_model and self._collect:
            st.hooks_on()
        elif st.hooked:
            st.hooks_off()

    def _take_grad_norm(self, slot: int, grad_norm: Any) -> None:
        """The loop's global norm; the first one switches the grad_norm signal to every step."""
        if not self._grad_norm_given:   # the norm exists every step: judge it at that cadence
            self._grad_norm_given = True
            self._cadence["grad_norm"] = 1
            if self.th_gnorm.step == 0:
                self.thresholds["grad_norm"] = self._new_threshold(
                    next(s for s in monitor_judging.SIGNALS if s.name == "grad_norm"))
        self.state.put_grad_norm(slot, grad_norm)

    def sync(self) -> None:
        """Copy the buffered numbers to the host (one transfer each) and judge them."""
        n, self._pending = self._pending, 0
        if n == 0 or self.state.buffers is None:
            return
        first_step = self.step - n + 1
        has_norm = self.state.model is not None or self._grad_norm_given
        th = self.thresholds
        for r, row in enumerate(self.state.host_rows(n, has_norm)):
            step = first_step + r
            rec, alerts, nonfinite = judge_step(self, step, row)
            self._nonfinite_seen |= nonfinite
            self.output.publish(step, rec["loss"], rec, alerts, self.th_loss, th["grad_norm"])
        self.output.flush()

    def close(self) -> None:
        """Judge what is still buffered, flush and close the sinks, remove the hooks."""
        self.sync()
        self.detach()
        self.output.close()


def watch_training(fn: Callable | None = None, *, model: torch.nn.Module | None = None,
                   **settings: Any):
    """Decorate a train step that returns the loss (a tensor, a float, a dict with "loss", or a
    tuple whose first item is the loss). A dict may also carry "grad_norm" (the global gradient
    norm the loop computed, e.g. clip_grad_norm_'s return: then it is judged every step at no
    cost) and "iteration" (the capture iteration, for loops that number it themselves). With
    ``model=`` (or when the step's first argument is an nn.Module) per-layer statistics are
    watched too. The monitor is ``step_fn.monitor``; call ``step_fn.monitor.close()`` at the
    end to judge the last buffered steps. The other keyword arguments go to
    :class:`TrainingMonitor`: the settings of :class:`MonitorThresholds` (warmup_steps=100,
    alert_window=50, sigma=3.0, rolling, overflow_margin, watch_dtype, cooldown) and
    :class:`MonitorCadence` (log_every, sync_every, layer_stats_every, sample_size,
    grad_norm_every), or those groups whole (thresholds=, cadence=), and sinks, layer_filter,
    on_alert.
    """
    def decorate(f: Callable) -> Callable:
        monitor = TrainingMonitor(model=model, **settings)

        @functools.wraps(f)
        def wrapper(*args: Any, **kw: Any) -> Any:
            if monitor.model is None and args and isinstance(args[0], torch.nn.Module):
                monitor.attach(args[0])
            result = f(*args, **kw)
            extra = result if isinstance(result, dict) else {}
            monitor.step_end(_loss_of(result), grad_norm=extra.get("grad_norm"),
                             iteration=extra.get("iteration"))
            return result

        wrapper.monitor = monitor
        return wrapper

    return decorate(fn) if fn is not None else decorate
