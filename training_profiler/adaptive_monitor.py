"""P1: ``@watch_training`` — a training-step decorator with thresholds learnt from the run itself.

Why this shape: users do not know whether a gradient norm of 100 is an explosion, so the first
``warmup_steps`` steps establish a baseline (mean, std, min, max) and later steps are judged
against it (mean ± sigma·std, and the seed's range doubling: above 2·max / below min/2). With
``rolling=True`` the mean/std come from the last ``alert_window`` normal values, so a slowly
improving loss does not alarm, while the range check against the warm-up keeps slow drifts
visible.

Cost: per step the hooks only launch a few reductions whose results are written into small
preallocated buffers on the tensors' device; nothing is copied to the host until every
``sync_every`` steps, when the buffers are read at once and judged in numpy. Only numbers are
kept, never tensors.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from quant.analysis import dtype_limits as quant_dtype_limits
from training_profiler._tensors import first_tensor

from training_profiler.monitor_sinks import Sink, make_sink

# Columns of the per-layer statistics row written by the hooks.
_ABSMAX, _OVERFLOW, _UNDERFLOW, _MEANABS = range(4)
_NSTATS = 4


def dtype_limits(dtype: torch.dtype) -> tuple[float, float]:
    """(max finite, smallest normal) of a floating dtype, from quant.analysis.dtype_limits.

    Underflow here means a nonzero value below the smallest normal: it has entered the
    subnormal range (losing mantissa bits) or, one step further, flushes to zero.
    """
    lim = quant_dtype_limits(dtype)
    return lim.max_normal, lim.min_normal


class AdaptiveThreshold:
    """Warm-up baseline + sigma test + range doubling, for one metric or a vector of them.

    ``update(values)`` feeds one step (a float or an array, one entry per series) and returns a
    boolean array of anomalies (all False during warm-up). NaN entries are "no data".
    ``direction`` is "up" (only increases alarm: losses, norms, ratios), "down" or "both".
    ``rel_floor``/``abs_floor`` bound the std from below so a perfectly flat warm-up does not
    turn every later wiggle into an alarm.
    """

    def __init__(self, warmup_steps: int = 100, sigma: float = 3.0, window: int | None = 50,
                 direction: str = "up", range_check: bool = True, rel_floor: float = 0.1,
                 abs_floor: float = 1e-12) -> None:
        if abs_floor <= 0:
            raise ValueError(f"abs_floor={abs_floor}: must be > 0 (it bounds the spread from below)")
        if warmup_steps < 2:
            raise ValueError(f"warmup_steps={warmup_steps}: need at least 2 steps to estimate a spread")
        if direction not in ("up", "down", "both"):
            raise ValueError(f"direction={direction!r}: use 'up', 'down' or 'both'")
        self.warmup_steps, self.sigma, self.window = warmup_steps, sigma, window
        self.direction, self.range_check = direction, range_check
        self.rel_floor, self.abs_floor = rel_floor, abs_floor
        self.step = 0
        self._warm: list[np.ndarray] = []
        self.baseline: dict[str, np.ndarray] | None = None
        self._ring: np.ndarray | None = None
        self._ring_pos = 0
        self.last_z: np.ndarray | None = None

    @property
    def ready(self) -> bool:
        return self.baseline is not None

    def _stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Current reference mean and std (rolling window when enabled, else warm-up)."""
        assert self.baseline is not None
        if self._ring is None:
            return self.baseline["mean"], self.baseline["std"]
        n = np.maximum(self._count, 1)
        mean = self._sum / n
        std = np.sqrt(np.maximum(self._sumsq / n - mean * mean, 0.0))
        empty = self._count == 0
        # A window with no normal value left (a long incident) falls back to the warm-up.
        if empty.any():
            mean = np.where(empty, self.baseline["mean"], mean)
            std = np.where(empty, self.baseline["std"], std)
        return mean, std

    def reference(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean, std) that the next value is judged against."""
        return self._stats()

    def _push(self, v: np.ndarray) -> None:
        """Put one row into the rolling window, keeping its sums up to date (NaN = no value)."""
        assert self._ring is not None
        old = self._ring[self._ring_pos]
        ok_old, ok_new = ~np.isnan(old), ~np.isnan(v)
        self._sum += np.where(ok_new, v, 0.0) - np.where(ok_old, old, 0.0)
        self._sumsq += np.where(ok_new, v * v, 0.0) - np.where(ok_old, old * old, 0.0)
        self._count += ok_new.astype(np.int64) - ok_old.astype(np.int64)
        self._ring[self._ring_pos] = v
        self._ring_pos = (self._ring_pos + 1) % len(self._ring)

    def update(self, values: Any) -> np.ndarray:
        v = np.atleast_1d(np.asarray(values, dtype=np.float64))
        self.step += 1
        if self.baseline is None:
            self._warm.append(v)
            if len(self._warm) >= self.warmup_steps:
                h = np.stack(self._warm)
                h = np.where(np.isfinite(h), h, np.nan)
                with np.errstate(all="ignore"), _quiet_nan_warnings():
                    self.baseline = {"mean": np.nanmean(h, 0), "std": np.nanstd(h, 0),
                                     "min": np.nanmin(h, 0), "max": np.nanmax(h, 0)}
                if self.window:
                    width = h.shape[1]
                    self._ring = np.full((self.window, width), np.nan)
                    self._sum, self._sumsq = np.zeros(width), np.zeros(width)
                    self._count = np.zeros(width, dtype=np.int64)
                    for r in h[-self.window:]:
                        self._push(r)
                self._warm = []
            self.last_z = np.zeros_like(v)
            return np.zeros(v.shape, dtype=bool)
        mean, std = self._stats()
        # spread >= abs_floor > 0, and comparisons with NaN are quietly False: no errstate needed
        # (this runs for every metric of every step, so it is kept lean).
        spread = np.maximum(np.maximum(std, self.rel_floor * np.abs(mean)), self.abs_floor)
        z = (v - mean) / spread
        self.last_z = z
        if self.direction == "up":
            bad = z > self.sigma
        elif self.direction == "down":
            bad = z < -self.sigma
        else:
            bad = np.abs(z) > self.sigma
        if self.range_check:
            lo, hi = self.baseline["min"], self.baseline["max"]
            if self.direction in ("up", "both"):
                bad |= (hi > 0) & (v > 2 * hi)
            if self.direction in ("down", "both"):
                bad |= (lo > 0) & (v < lo / 2)
        finite = np.isfinite(v)
        bad &= finite
        # Judge only against a real reference: a warm-up that saw the series, or a window holding
        # at least 3 values (a series first seen after the warm-up starts quiet).
        has_base = np.isfinite(self.baseline["mean"])
        if self._ring is not None:
            bad &= np.where(self._count == 0, has_base, self._count >= 3)
        else:
            bad &= has_base
        if self._ring is not None:  # anomalies do not enter the reference window
            self._push(np.where(bad | ~finite, np.nan, v))
        return bad


class _quiet_nan_warnings:
    def __enter__(self):
        import warnings
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("ignore", category=RuntimeWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def _loss_of(result: Any) -> Any:
    if isinstance(result, dict):
        return result.get("loss")
    if isinstance(result, (tuple, list)) and result:
        return result[0]
    return result


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


# ---- the signals ------------------------------------------------------------------------------
class _StepView:
    """One synced step's numbers, parsed once for the signals to read."""

    __slots__ = ("step", "row", "loss", "gnorm", "layer_norms", "has_layers")

    def __init__(self, monitor: "TrainingMonitor", step: int, row: dict[str, np.ndarray]) -> None:
        self.step, self.row = step, row
        self.loss = float(row["loss"])
        self.gnorm: float | None = None          # None: no model; < 0: no gradients this step
        self.layer_norms: np.ndarray | None = None
        self.has_layers = monitor.model is not None and "gnorm" in row   # per-layer data possible
        if self.has_layers:
            g = row["gnorm"]
            self.gnorm = float(g[0])
            norms = g[1:1 + len(monitor.layers)]
            if not self.gnorm < 0 and len(norms) == len(monitor.layers) > 0:
                self.layer_norms = norms

    def stats(self, monitor: "TrainingMonitor", kind: str) -> np.ndarray | None:
        """The per-layer statistics rows of ``kind`` ("act" / "grad"), None when not taken."""
        if not self.has_layers or kind not in self.row:
            return None
        return self.row[kind][:len(monitor.layers)]


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
    read: Callable[["TrainingMonitor", _StepView], Any]
    threshold: dict[str, Any] | None = None
    per_layer: bool = False
    record: str | None = None
    summary: Callable[["TrainingMonitor", AdaptiveThreshold, Any], Any] | None = None
    note: str | Callable[..., str] = ""
    alerts: bool = True


def _nanmax_or_nan(_m: Any, _th: Any, v: np.ndarray) -> float:
    return float(np.nanmax(v)) if np.isfinite(v).any() else float("nan")


def _distortion_max(_m: Any, th: AdaptiveThreshold, scale: np.ndarray) -> float | None:
    if not th.ready:
        return None
    mean, _ = th.reference()
    with np.errstate(all="ignore"):
        shift = np.abs(scale - mean)
    return float(np.nanmax(shift)) if np.isfinite(shift).any() else 0.0


def _act_scale(m: "TrainingMonitor", v: _StepView) -> np.ndarray | None:
    """Each layer's activation scale, log2 mean|x| (binades); NaN where undefined."""
    act = v.stats(m, "act")
    if act is None:
        return None
    with np.errstate(all="ignore"):
        scale = np.log2(act[:, _MEANABS])
    return np.where(np.isfinite(scale), scale, np.nan)


def _grad_norm_note(m: "TrainingMonitor", v: _StepView, th: AdaptiveThreshold, value: float) -> str:
    note = m._why(th, value)
    z = m.th_layer_gnorm.last_z
    if v.layer_norms is not None and z is not None and len(z) and np.isfinite(z).any():
        note += f"; largest layer jump: '{m.layers[int(np.nanargmax(z))]}'"
    return note


def _absmax(kind: str) -> Callable[["TrainingMonitor", _StepView], Any]:
    def read(m: "TrainingMonitor", v: _StepView) -> np.ndarray | None:
        stats = v.stats(m, kind)
        return None if stats is None else stats[:, _ABSMAX]
    return read


def _ratios(kind: str, col: int) -> Callable[["TrainingMonitor", _StepView], Any]:
    def read(m: "TrainingMonitor", v: _StepView) -> np.ndarray | None:
        stats = v.stats(m, kind)
        return None if stats is None else m._ratio(stats, col, kind)
    return read


def _range_signals(kind: str, what: str, order: str) -> tuple[Signal, ...]:
    """A kind's non-finite check and its overflow / underflow ratio signals."""
    ratio = dict(direction="up", range_check=False, rel_floor=0.5, abs_floor=1e-4)
    return (Signal(f"{kind}_nonfinite", _absmax(kind), per_layer=True,
                   note=f"non-finite {what} (first watched layer in {order} order)"),) + tuple(
        Signal(f"{kind}_{name}_ratio", _ratios(kind, col), ratio, per_layer=True,
               record=f"{kind}_{name}_ratio_max", summary=_nanmax_or_nan)
        for name, col in (("overflow", _OVERFLOW), ("underflow", _UNDERFLOW)))


#: Every signal the monitor judges, in the order its alerts and history fields appear.
SIGNALS: tuple[Signal, ...] = (
    Signal("loss_nonfinite", lambda m, v: v.loss, note="non-finite loss"),
    Signal("loss", lambda m, v: v.loss, dict(direction="up"),
           note=lambda m, v, th, x: m._why(th, x)),
    Signal("grad_norm_nonfinite", lambda m, v: None if v.gnorm is None or v.gnorm < 0 else v.gnorm,
           note="non-finite gradient norm"),
    # before grad_norm: its alert names the layer whose norm jumped most this step
    Signal("layer_grad_norm", lambda m, v: v.layer_norms, dict(direction="up", range_check=False),
           per_layer=True, alerts=False),
    Signal("grad_norm", lambda m, v: None if v.gnorm is None else (math.nan if v.gnorm < 0 else v.gnorm),
           dict(direction="up"), record="grad_norm", note=_grad_norm_note),
    *_range_signals("act", "activations", "forward"),
    *_range_signals("grad", "output gradients", "module"),
    Signal("distortion", _act_scale,
           dict(direction="both", range_check=False, rel_floor=0.0, abs_floor=0.25),
           per_layer=True, record="distortion_max_binades", summary=_distortion_max,
           note="activation scale (log2 mean|x|) shifted from its baseline"),
)


class TrainingMonitor:
    """The state behind ``@watch_training``; usable directly with ``step(loss)``."""

    def __init__(self, warmup_steps: int = 100, alert_window: int = 50, sigma: float = 3.0,
                 model: torch.nn.Module | None = None, log_every: int = 100, sync_every: int = 10,
                 watch_dtype: torch.dtype | None = None, rolling: bool = True,
                 sinks: Iterable[str | Sink] = ("stdout",), layer_filter: Callable[[str, torch.nn.Module], bool] | None = None,
                 overflow_margin: float = 1.0, on_alert: Callable[[dict[str, Any]], None] | None = None,
                 cooldown: int = 10, layer_stats_every: int = 10, sample_size: int = 4096,
                 grad_norm_every: int = 1) -> None:
        if sync_every < 1 or log_every < 1 or layer_stats_every < 1:
            raise ValueError("sync_every, log_every and layer_stats_every must be >= 1")
        self.layer_stats_every, self.sample_size = layer_stats_every, sample_size
        # Reading every gradient costs memory bandwidth: trivial on a GPU, milliseconds for a
        # large model on a CPU; grad_norm_every > 1 thins it out (statistics steps always have it).
        self.grad_norm_every = max(1, grad_norm_every)
        self.warmup_steps, self.sigma, self.log_every = warmup_steps, sigma, log_every
        self.sync_every, self.watch_dtype, self.overflow_margin = sync_every, watch_dtype, overflow_margin
        self.layer_filter = layer_filter
        self.sinks: list[Sink] = [make_sink(s) for s in sinks]
        self.on_alert = on_alert
        self.cooldown = cooldown
        self._last_emitted: dict[tuple[str, str | None], int] = {}
        self.suppressed_alerts = 0
        window = alert_window if rolling else None
        mk = functools.partial(AdaptiveThreshold, warmup_steps, sigma, window)
        # Layer statistics are taken every layer_stats_every steps, so their thresholds warm up
        # and roll over proportionally fewer samples.
        lw = max(2, warmup_steps // layer_stats_every)
        lwin = max(2, alert_window // layer_stats_every) if rolling else None
        mkl = functools.partial(AdaptiveThreshold, lw, sigma, lwin)
        #: signal name -> its AdaptiveThreshold (one per adaptive signal of SIGNALS)
        self.thresholds: dict[str, AdaptiveThreshold] = {
            sig.name: (mkl if sig.per_layer else mk)(**sig.threshold)
            for sig in SIGNALS if sig.threshold is not None}
        th = self.thresholds
        self.th_loss, self.th_gnorm, self.th_layer_gnorm = th["loss"], th["grad_norm"], th["layer_grad_norm"]
        self.th_ratio = {k: th[f"{k}_ratio"]
                         for k in ("act_overflow", "act_underflow", "grad_overflow", "grad_underflow")}
        self.th_dist = th["distortion"]
        self._collect = layer_stats_every == 1  # are the hooks recording during this step?
        self._slot_has_stats = [False] * sync_every
        self.step = 0
        self._nonfinite_seen = False
        self.alerts: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []  # per-step scalars (numbers only)
        self.model: torch.nn.Module | None = None
        self.layers: list[str] = []
        self._numel: dict[str, np.ndarray] = {}
        self._handles: list[Any] = []
        self._buffers: dict[str, torch.Tensor] | None = None
        self._pending = 0
        self._limits: dict[torch.dtype, tuple[float, float]] = {}
        if model is not None:
            self.attach(model)

    # ---- setup -------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Install forward hooks (and output-gradient hooks) on the watched layers."""
        self.detach()
        self.model = model
        chosen = [(n, m) for n, m in model.named_modules()
                  if (self.layer_filter(n, m) if self.layer_filter
                      else (not list(m.children()) and any(True for _ in m.parameters(recurse=False))))]
        self.layers = [n for n, _ in chosen]
        self._params = [p for p in model.parameters() if p.requires_grad]
        owner = {id(p): i for i, (_, m) in enumerate(chosen) for p in m.parameters(recurse=False)}
        L = len(chosen)
        # Parameters outside watched layers count in the global norm only (index L = "rest").
        self._param_layer = torch.tensor([owner.get(id(p), L) for p in self._params], dtype=torch.long)
        dev = next(iter(model.parameters()), torch.empty(0)).device
        S = self.sync_every
        self._buffers = {
            "loss": torch.zeros(S, device=dev),
            "gnorm": torch.zeros(S, L + 2, device=dev),  # [global, layer 0..L-1, rest]
            "act": torch.zeros(S, max(L, 1), _NSTATS, device=dev),
            "grad": torch.zeros(S, max(L, 1), _NSTATS, device=dev),
        }
        self._param_layer = self._param_layer.to(dev)
        self._numel = {"act": np.zeros(L), "grad": np.zeros(L)}
        for i, (_, m) in enumerate(chosen):
            self._handles.append(m.register_forward_hook(self._make_hook(i)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _limits_for(self, dtype: torch.dtype) -> tuple[float, float]:
        d = self.watch_dtype or dtype
        if d not in self._limits:   # quant.analysis' overflow / underflow, compared in float32
            lim = quant_dtype_limits(d)
            self._limits[d] = (lim.overflow_bound(torch.float32) * self.overflow_margin,
                               lim.underflow_bound(torch.float32))
        return self._limits[d]

    def _record(self, kind: str, i: int, t: torch.Tensor) -> None:
        """Write one layer's statistics row into the device buffer (no host sync).

        The absolute max (which also exposes NaN/Inf, since both propagate through min/max) is
        computed over the whole tensor; the overflow/underflow ratios and mean|x| over an evenly
        strided sample of at most ``sample_size`` elements, which keeps the cost flat in the
        tensor size.
        """
        over, tiny = self._limits_for(t.dtype)
        flat = t.detach().reshape(-1)
        mn, mx = torch.aminmax(flat)
        stride = max(1, flat.numel() // self.sample_size)
        a = flat[::stride].abs().float()
        row = torch.stack((torch.maximum(mx, -mn).float(), (a >= over).sum().float(),
                           ((a < tiny) & (a != 0)).sum().float(), a.mean()))
        self._buffers[kind][self._pending, i].copy_(row)  # type: ignore[index]
        self._numel[kind][i] = a.numel()

    def _make_hook(self, i: int):
        def hook(module, args, output):
            if not self._collect:
                return
            t = first_tensor(output)
            if t is None or not t.is_floating_point():
                return
            self._record("act", i, t)
            if t.requires_grad:
                t.register_hook(lambda g: self._record("grad", i, g) if g is not None else None)
        return hook

    # ---- per step ------------------------------------------------------------------------
    def step_end(self, loss: Any) -> None:
        """Record this step's loss and gradient norms (on device), judge every sync_every steps.

        Every step: the loss and the global gradient norm (a handful of small device ops).
        On statistics steps also the per-layer gradient norms.
        """
        b = self._buffers
        if b is None:
            self._buffers = b = {"loss": torch.zeros(self.sync_every)}
        slot = self._pending
        if isinstance(loss, torch.Tensor):
            b["loss"][slot].copy_(loss.detach().float().mean() if loss.numel() != 1 else loss.detach().reshape(()))
        else:
            b["loss"][slot] = float(loss) if loss is not None else float("nan")
        if self.model is not None and not self._collect and (self.step + 1) % self.grad_norm_every:
            b["gnorm"][slot].fill_(-1.0)  # not measured this step
        elif self.model is not None:
            grads = [p.grad for p in self._params]
            row = b["gnorm"][slot]
            if all(g is not None for g in grads) and grads:
                norms = torch.stack(torch._foreach_norm(grads))
                idx = self._param_layer
            else:
                keep = [(g, j) for g, j in zip(grads, self._param_layer.tolist()) if g is not None]
                norms = torch.stack(torch._foreach_norm([g for g, _ in keep])) if keep else None
                idx = torch.tensor([j for _, j in keep], dtype=torch.long, device=row.device)
            if norms is None:
                row.fill_(-1.0)  # no gradients this step (not the same as NaN gradients)
            elif self._collect:
                sq = norms.float().square()
                row.zero_()
                row[1:].index_add_(0, idx, sq)
                row[0] = sq.sum()
                row.sqrt_()
            else:
                row[0] = torch.linalg.vector_norm(norms.float())
        self._slot_has_stats[slot] = self._collect
        self.step += 1
        self._pending += 1
        if self._pending == self.sync_every:
            self.sync()
        # Hooks record during the next step when it is a statistics step, or every step after a
        # non-finite loss was seen (to name the layer where it starts).
        self._collect = (self.step + 1) % self.layer_stats_every == 0 or self._nonfinite_seen

    def sync(self) -> None:
        """Copy the buffered statistics to the host (one transfer each) and judge them."""
        n, self._pending = self._pending, 0
        if n == 0 or self._buffers is None:
            return
        host = {k: v[:n].cpu().numpy().astype(np.float64) for k, v in self._buffers.items()}
        first_step = self.step - n + 1
        for r in range(n):
            row = {k: v[r] for k, v in host.items()}
            if not self._slot_has_stats[r]:
                row.pop("act", None), row.pop("grad", None)
                if "gnorm" in row:
                    row["gnorm"] = row["gnorm"][:1]  # global norm only on this step
            self._judge(first_step + r, row)
        for s in self.sinks:
            s.flush()

    def _ratio(self, stats: np.ndarray, col: int, kind: str) -> np.ndarray:
        with np.errstate(all="ignore"):
            return np.where(self._numel[kind] > 0, stats[:, col] / np.maximum(self._numel[kind], 1), np.nan)

    def _judge(self, step: int, row: dict[str, np.ndarray]) -> None:
        """Read and judge every signal of SIGNALS for one step, in table order; publish."""
        view = _StepView(self, step, row)
        rec: dict[str, Any] = {"kind": "metrics", "step": step, "loss": view.loss}
        alerts: list[dict[str, Any]] = []
        for sig in SIGNALS:
            value = sig.read(self, view)
            if value is None:
                continue
            if sig.threshold is None:
                self._judge_nonfinite(sig, view, value, alerts)
            else:
                self._judge_adaptive(sig, view, value, rec, alerts)
        self._publish(step, view.loss, rec, alerts)

    def _alert(self, alerts: list[dict[str, Any]], step: int, metric: str, value: float,
               th: AdaptiveThreshold | None, idx: int = 0, layer: str | None = None,
               note: str = "") -> None:
        msg = f"[ALERT] Step {step} | "
        if layer is not None:
            msg += f"Layer '{layer}' "
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
        alerts.append({"kind": "alert", "step": step, "metric": metric, "value": value,
                       "layer": layer, "baseline_mean": base_mean, "baseline_std": base_std,
                       "deviation": dev, "message": msg})

    def _judge_nonfinite(self, sig: Signal, view: _StepView, value: Any,
                         alerts: list[dict[str, Any]]) -> None:
        """Non-finite values need no baseline; per layer, the first such layer is named."""
        if sig.per_layer:
            bad = ~np.isfinite(value)
            if not bad.any():
                return
            i = int(np.argmax(bad))
            value, layer = float(value[i]), self.layers[i]
        elif math.isfinite(value):
            return
        else:
            layer = None
        self._nonfinite_seen = True
        self._alert(alerts, view.step, sig.name, value, None, layer=layer,
                    note=sig.note if isinstance(sig.note, str) else sig.note(self, view, None, value))

    def _judge_adaptive(self, sig: Signal, view: _StepView, value: Any, rec: dict[str, Any],
                        alerts: list[dict[str, Any]]) -> None:
        th = self.thresholds[sig.name]
        if sig.per_layer:
            bad = th.update(value)
        else:   # a scalar teaches its baseline only finite values (its non-finite signal alarms)
            bad = th.update(value) if math.isfinite(value) else None
        if sig.record is not None:
            summary = value if sig.summary is None else sig.summary(self, th, value)
            if summary is not None:
                rec[sig.record] = summary
        if not sig.alerts or bad is None:
            return
        for i in np.flatnonzero(bad):
            v = float(value[i]) if sig.per_layer else value
            note = sig.note if isinstance(sig.note, str) else sig.note(self, view, th, v)
            self._alert(alerts, view.step, sig.name, v, th, idx=int(i),
                        layer=self.layers[i] if sig.per_layer else None, note=note)

    def _publish(self, step: int, loss: float, rec: dict[str, Any],
                 alerts: list[dict[str, Any]]) -> None:
        """History, sinks, the baseline notice, alerts (with their cool-down) and the status line."""
        self.history.append({k: v for k, v in rec.items() if k != "kind"})
        for s in self.sinks:
            s.emit(rec)
        if step == self.warmup_steps and self.th_loss.ready:
            mean, std = self.th_loss.reference()
            self._emit({"kind": "info", "step": step, "message":
                        f"[Monitor] Baseline established at step {step}: loss {_fmt(mean[0])}±{_fmt(std[0])}"
                        + (f", grad_norm {_fmt(self.th_gnorm.reference()[0][0])}±"
                           f"{_fmt(self.th_gnorm.reference()[1][0])}" if self.th_gnorm.ready else "")})
        for a in alerts:
            self.alerts.append(a)
            key = (a["metric"], a["layer"])
            last = self._last_emitted.get(key)
            if last is not None and step - last <= self.cooldown:
                # The same problem again within the cool-down: kept in .alerts, not printed.
                self.suppressed_alerts += 1
                self._last_emitted[key] = step
                continue
            self._last_emitted[key] = step
            self._emit(a)
            if self.on_alert:
                self.on_alert(a)
        if step % self.log_every == 0:
            parts = [f"[Monitor] Step {step}", self._status_part("loss", loss, self.th_loss)]
            if "grad_norm" in rec:
                parts.append(self._status_part("grad_norm", rec["grad_norm"], self.th_gnorm))
            parts.append("Status: " + ("ALERT" if alerts else ("WARMUP" if not self.th_loss.ready else "OK")))
            self._emit({"kind": "status", "step": step, "message": " | ".join(parts)})

    def _why(self, th: AdaptiveThreshold, value: float) -> str:
        assert th.baseline is not None
        if th.range_check and th.baseline["max"][0] > 0 and value > 2 * th.baseline["max"][0]:
            return f"above 2x the warm-up max {_fmt(float(th.baseline['max'][0]))}"
        return f"beyond {th.sigma:g}σ"

    @staticmethod
    def _status_part(name: str, value: float, th: AdaptiveThreshold) -> str:
        if th.ready:
            mean, std = th.reference()
            return f"{name}: {_fmt(value)} (baseline: {_fmt(float(mean[0]))}±{_fmt(float(std[0]))})"
        return f"{name}: {_fmt(value)}"

    def _emit(self, rec: dict[str, Any]) -> None:
        for s in self.sinks:
            s.emit(rec)

    def close(self) -> None:
        """Judge what is still buffered, flush and close the sinks, remove the hooks."""
        self.sync()
        self.detach()
        for s in self.sinks:
            s.close()


def watch_training(fn: Callable | None = None, *, warmup_steps: int = 100, alert_window: int = 50,
                   sigma: float = 3.0, model: torch.nn.Module | None = None, **kwargs: Any):
    """Decorate a train step that returns the loss (a tensor, a float, a dict with "loss", or a
    tuple whose first item is the loss). With ``model=`` (or when the step's first argument is an
    nn.Module) per-layer statistics are watched too. The monitor is ``step_fn.monitor``; call
    ``step_fn.monitor.close()`` at the end to judge the last buffered steps. Other keyword
    arguments go to :class:`TrainingMonitor` (log_every, sync_every, watch_dtype, rolling,
    sinks, layer_filter, overflow_margin, on_alert).
    """
    def decorate(f: Callable) -> Callable:
        monitor = TrainingMonitor(warmup_steps=warmup_steps, alert_window=alert_window, sigma=sigma,
                                  model=model, **kwargs)

        @functools.wraps(f)
        def wrapper(*args: Any, **kw: Any) -> Any:
            if monitor.model is None and args and isinstance(args[0], torch.nn.Module):
                monitor.attach(args[0])
            result = f(*args, **kw)
            monitor.step_end(_loss_of(result))
            return result

        wrapper.monitor = monitor  # type: ignore[attr-defined]
        return wrapper

    return decorate(fn) if fn is not None else decorate
