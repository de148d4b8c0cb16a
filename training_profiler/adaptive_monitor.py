"""P1: ``@watch_training`` — a training-step decorator with thresholds learnt from the run itself.

Why this shape: users do not know whether a gradient norm of 100 is an explosion, so the first
``warmup_steps`` steps establish a baseline (mean, std, min, max) and later steps are judged
against it (mean ± sigma·std, and the seed's range doubling: above 2·max / below min/2). With
``rolling=True`` the mean/std come from the last ``alert_window`` normal values, so a slowly
improving loss does not alarm, while the range check against the warm-up keeps slow drifts
visible.

Cost: a step that is neither a statistics step (every ``layer_stats_every``) nor a gradient-norm
step (every ``grad_norm_every``, by default the statistics steps) costs one small device copy
(the loss): the layer hooks are installed only for statistics steps, and the global gradient
norm, which reads every gradient, is taken from the training step when it returns one
(``{"loss": ..., "grad_norm": ...}``). On statistics steps each hook writes the tensor's min,
max and an evenly strided sample into preallocated device buffers; the ratios of all
layers are then computed in one batched pass. Nothing is copied to the host until every
``sync_every`` steps, when the buffers are read at once and judged in numpy. Only numbers are
kept, never tensors.
"""
from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from quant.analysis import dtype_limits as quant_dtype_limits
from training_profiler._tensors import first_tensor

from training_profiler.monitor_sinks import Sink, make_sink

# Columns of the per-layer statistics row of a statistics step: on the device absmax and the
# counts (overflowing, underflowing, sum |x|) over the sample; on the host the counts become
# ratios and the sum the mean (divided by the sample size).
_ABSMAX, _OVERFLOW, _UNDERFLOW, _MEANABS = range(4)
_NSTATS = 4
#: The two watched tensors of a layer: index in the buffers, and how alerts name them.
_KINDS = ("act", "grad")
TENSOR_LABELS = {"act": "forward output", "grad": "output gradient"}


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
        if self.baseline is not None and isinstance(values, float):
            self.step += 1
            return self._update_scalar(values)
        return self._update_array(np.atleast_1d(np.asarray(values, dtype=np.float64)))

    def _update_scalar(self, x: float) -> np.ndarray:
        """:meth:`_update_array` for one series after the warm-up, in Python floats: the same
        operations in the same order (so the same bits; a test compares the two paths), at a
        tenth of the cost: the loss and the global norm are judged every step."""
        b = self.baseline
        assert b is not None
        cnt = int(self._count[0]) if self._ring is not None else 0
        if cnt:
            mean = float(self._sum[0]) / cnt
            std = math.sqrt(_fmax(float(self._sumsq[0]) / cnt - mean * mean, 0.0))
        else:   # no window, or a window emptied by a long incident: the warm-up's numbers
            mean, std = float(b["mean"][0]), float(b["std"][0])
        spread = _fmax(_fmax(std, self.rel_floor * abs(mean)), self.abs_floor)
        z = (x - mean) / spread
        self.last_z = np.array([z])
        d = self.direction
        bad = z > self.sigma if d == "up" else z < -self.sigma if d == "down" else abs(z) > self.sigma
        if self.range_check:
            lo, hi = float(b["min"][0]), float(b["max"][0])
            if d in ("up", "both"):
                bad = bad or (hi > 0 and x > 2 * hi)
            if d in ("down", "both"):
                bad = bad or (lo > 0 and x < lo / 2)
        finite = math.isfinite(x)
        has_base = math.isfinite(float(b["mean"][0]))
        bad = bad and finite and (cnt >= 3 if cnt else has_base)
        if self._ring is not None:
            pos = self._ring_pos
            old = float(self._ring[pos, 0])
            new = math.nan if bad or not finite else x
            ok_old, ok_new = old == old, new == new
            self._sum[0] += (new if ok_new else 0.0) - (old if ok_old else 0.0)
            self._sumsq[0] += (new * new if ok_new else 0.0) - (old * old if ok_old else 0.0)
            self._count[0] += int(ok_new) - int(ok_old)
            self._ring[pos, 0] = new
            self._ring_pos = (pos + 1) % len(self._ring)
        return np.array([bad])

    def _update_array(self, v: np.ndarray) -> np.ndarray:
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


def _fmax(a: float, b: float) -> float:
    """np.maximum for two floats: NaN if either is NaN."""
    return a if a >= b or a != a else b


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

    __slots__ = ("step", "row", "loss", "gnorm", "layer_norms", "has_layers", "iteration")

    def __init__(self, monitor: "TrainingMonitor", step: int, row: dict[str, Any]) -> None:
        self.step, self.row = step, row
        self.loss = float(row["loss"])
        self.iteration: int | None = row.get("iteration")
        # None: no gradient norm can exist (no model, none given); < 0: not measured this step
        # or no gradients
        self.gnorm: float | None = None
        self.layer_norms: np.ndarray | None = None
        self.has_layers = monitor.model is not None   # per-layer data possible
        g = row.get("gnorm")
        if g is not None:
            self.gnorm = float(g[0])
            norms = g[1:1 + len(monitor.layers)]
            if self.has_layers and len(norms) == len(monitor.layers) > 0 and (norms >= 0).all():
                self.layer_norms = norms

    def stats(self, monitor: "TrainingMonitor", kind: str) -> np.ndarray | None:
        """The per-layer rows of ``kind`` ("act" / "grad"): absmax, overflow ratio, underflow
        ratio, mean|x|; None when not taken this step."""
        st = self.row.get("stats")
        if not self.has_layers or st is None:
            return None
        return st[_KINDS.index(kind)]


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


def _capture_iteration() -> int | None:
    """The process-wide capture saver's iteration when a capture is configured on. Read from
    sys.modules: a process that never loaded the saver captures nothing, and importing it here
    would cost every monitored run the capture package."""
    mod = sys.modules.get("tensor_capture.saver")
    saver = mod.current_saver() if mod is not None else None
    if saver is None or not saver.config.enabled:
        return None
    return saver.iteration


def _stats_rows(stats: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Device statistics rows [kind, layer, (absmax, #over, #under, sum|x|)] and the sample
    sizes -> (absmax, overflow ratio, underflow ratio, mean|x|); a tensor not seen this step
    has NaN ratios (no data) and absmax 0 (not a non-finite alarm)."""
    seen = counts > 0
    with np.errstate(all="ignore"):
        out = stats / np.maximum(counts, 1)[..., None]
    out = np.where(seen[..., None], out, np.nan)
    out[..., _ABSMAX] = np.where(seen, stats[..., _ABSMAX], 0.0)
    return out


class TrainingMonitor:
    """The state behind ``@watch_training``; usable directly with ``step_end(loss, ...)``."""

    def __init__(self, warmup_steps: int = 100, alert_window: int = 50, sigma: float = 3.0,
                 model: torch.nn.Module | None = None, log_every: int = 100, sync_every: int = 10,
                 watch_dtype: torch.dtype | None = None, rolling: bool = True,
                 sinks: Iterable[str | Sink] = ("stdout",), layer_filter: Callable[[str, torch.nn.Module], bool] | None = None,
                 overflow_margin: float = 1.0, on_alert: Callable[[dict[str, Any]], None] | None = None,
                 cooldown: int = 10, layer_stats_every: int = 10, sample_size: int = 4096,
                 grad_norm_every: int | None = None) -> None:
        if sync_every < 1 or log_every < 1 or layer_stats_every < 1 or sample_size < 1:
            raise ValueError("sync_every, log_every, layer_stats_every and sample_size must be >= 1")
        self.layer_stats_every, self.sample_size = layer_stats_every, sample_size
        # The global gradient norm reads every gradient (memory-bound: ~0.6 ms/step for 13 MB
        # of gradients on one CPU core), so unless the step returns it, it is measured every
        # grad_norm_every steps: by default on the statistics steps, which read every gradient
        # for the per-layer norms anyway.
        self.grad_norm_every = layer_stats_every if grad_norm_every is None else max(1, grad_norm_every)
        self.warmup_steps, self.sigma, self.log_every = warmup_steps, sigma, log_every
        self.alert_window, self.rolling = alert_window, rolling
        self.sync_every, self.watch_dtype, self.overflow_margin = sync_every, watch_dtype, overflow_margin
        self.layer_filter = layer_filter
        self.sinks: list[Sink] = [make_sink(s) for s in sinks]
        self.on_alert = on_alert
        self.cooldown = cooldown
        self._last_emitted: dict[tuple[str, str | None], int] = {}
        self.suppressed_alerts = 0
        #: steps between two values of a signal, by its cadence (thresholds warm up and roll over
        #: proportionally fewer values)
        self._cadence = {"step": 1, "stats": layer_stats_every,
                         "grad_norm": min(self.grad_norm_every, layer_stats_every)}
        #: signal name -> its AdaptiveThreshold (one per adaptive signal of SIGNALS)
        self.thresholds: dict[str, AdaptiveThreshold] = {
            sig.name: self._new_threshold(sig) for sig in SIGNALS if sig.threshold is not None}
        th = self.thresholds
        self.th_loss, self.th_layer_gnorm = th["loss"], th["layer_grad_norm"]
        self.th_ratio = {k: th[f"{k}_ratio"]
                         for k in ("act_overflow", "act_underflow", "grad_overflow", "grad_underflow")}
        self.th_dist = th["distortion"]
        self._collect = layer_stats_every == 1  # are the hooks recording during this step?
        # Per buffered step (slot), host side: statistics taken, gradient norm measured, the
        # sample sizes of the statistics, the global norm the step returned (a number), the
        # capture iteration.
        self._slot_has_stats = [False] * sync_every
        self._slot_gnorm = [False] * sync_every
        self._slot_given: list[float | None] = [None] * sync_every
        self._slot_iteration: list[int | None] = [None] * sync_every
        self._slot_counts = np.zeros((sync_every, 2, 0))
        self._grad_norm_given = False
        self.step = 0
        self._nonfinite_seen = False
        self.alerts: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []  # per-step scalars (numbers only)
        self.model: torch.nn.Module | None = None
        self.layers: list[str] = []
        self._modules: list[torch.nn.Module] = []
        self._capture_sites: dict[int, tuple[str | None, int | None]] | None = None
        self._handles: list[Any] = []
        self._buffers: dict[str, torch.Tensor] | None = None
        self._pending = 0
        self._limits: dict[torch.dtype, tuple[float, float]] = {}
        if model is not None:
            self.attach(model)

    @property
    def th_gnorm(self) -> AdaptiveThreshold:
        return self.thresholds["grad_norm"]

    def _new_threshold(self, sig: Signal) -> AdaptiveThreshold:
        every = self._cadence[sig.cadence]
        warm = self.warmup_steps if every == 1 else max(2, self.warmup_steps // every)
        window = (self.alert_window if every == 1 else max(2, self.alert_window // every)) if self.rolling else None
        return AdaptiveThreshold(warm, self.sigma, window, **(sig.threshold or {}))

    # ---- setup -------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Choose the watched layers and preallocate the buffers (hooks go on per statistics step)."""
        self.detach()
        self.model = model
        chosen = [(n, m) for n, m in model.named_modules()
                  if (self.layer_filter(n, m) if self.layer_filter
                      else (not list(m.children()) and any(True for _ in m.parameters(recurse=False))))]
        self.layers = [n for n, _ in chosen]
        self._modules = [m for _, m in chosen]
        self._capture_sites = None
        self._params = [p for p in model.parameters() if p.requires_grad]
        owner = {id(p): i for i, (_, m) in enumerate(chosen) for p in m.parameters(recurse=False)}
        L = len(chosen)
        # Parameters outside watched layers count in the global norm only (index L = "rest").
        self._param_layer_host = [owner.get(id(p), L) for p in self._params]
        dev = next(iter(model.parameters()), torch.empty(0)).device
        self._alloc(dev, L)
        self._param_layer = torch.tensor(self._param_layer_host, dtype=torch.long, device=dev)
        if self._collect:
            self._hooks_on()

    def _alloc(self, dev: torch.device, L: int) -> None:
        S, N = self.sync_every, self.sample_size
        self._buffers = {
            "loss": torch.zeros(S, device=dev),
            "gnorm": torch.zeros(S, L + 2, device=dev),  # [global, layer 0..L-1, rest]
            "stats": torch.zeros(S, 2, L, _NSTATS, device=dev),
        }
        # One statistics step's scratch: each hook writes its tensor's min and max into columns
        # N, N+1 and an evenly strided sample into columns 0..n-1 (the rest stays zero, which
        # counts as neither overflow nor underflow and adds nothing to sum |x|).
        self._scratch = torch.zeros(2, L, N + 2, device=dev)
        self._sample_rows = [[self._scratch[k, i, :N] for i in range(L)] for k in range(2)]
        self._minmax = [[(self._scratch[k, i, N], self._scratch[k, i, N + 1], self._scratch[k, i, N:])
                         for i in range(L)] for k in range(2)]
        self._n = np.zeros((2, L))                       # sample sizes of this step
        self._slot_counts = np.zeros((S, 2, L))
        self._bounds = np.zeros((2, 2, L))               # [overflow, underflow] bound per row
        self._bounds_dev = torch.zeros(2, 2, L, 1, device=dev)
        self._bounds_dirty = True

    def detach(self) -> None:
        self._hooks_off()

    def _hooks_on(self) -> None:
        if not self._handles:
            self._handles = [m.register_forward_hook(self._make_hook(i))
                             for i, m in enumerate(self._modules)]

    def _hooks_off(self) -> None:
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

    def _record(self, k: int, i: int, t: torch.Tensor) -> None:
        """Write one tensor's min, max and sample into the scratch buffer (no host sync).

        The min and max (whose absolute max also exposes NaN/Inf, since both propagate through
        them) are taken over the whole tensor; the overflow/underflow ratios and mean|x| later
        (:meth:`_finish_stats`, all layers at once) over an evenly strided sample of at most
        ``sample_size`` elements, which keeps the cost flat in the tensor size. Values are
        compared in float32, as the bounds are.
        """
        flat = t.detach().reshape(-1)
        numel = flat.numel()
        if numel == 0:
            return
        over, tiny = self._limits_for(t.dtype)
        b = self._bounds
        if b[0, k, i] != over or b[1, k, i] != tiny:
            b[0, k, i], b[1, k, i] = over, tiny
            self._bounds_dirty = True
        mn, mx, both = self._minmax[k][i]
        if flat.dtype == torch.float32:   # straight into the buffer (inf-norm is ~20x slower on CPU)
            torch.aminmax(flat, out=(mn, mx))
        else:
            both.copy_(torch.stack(torch.aminmax(flat)))
        sample = flat[::-(-numel // self.sample_size)]
        n = sample.numel()
        self._sample_rows[k][i][:n].copy_(sample)
        self._n[k, i] = n

    def _make_hook(self, i: int):
        def on_grad(g: torch.Tensor | None) -> None:
            if g is not None:
                self._record(1, i, g)

        def hook(module, args, output):
            t = first_tensor(output)
            if t is None or not t.is_floating_point():
                return
            self._record(0, i, t)
            if t.requires_grad:
                t.register_hook(on_grad)
        return hook

    # ---- per step ------------------------------------------------------------------------
    def step_end(self, loss: Any, grad_norm: Any = None, iteration: int | None = None) -> None:
        """Record this step's loss, gradient norms and statistics (on device); judge every
        sync_every steps.

        ``grad_norm``: the global gradient norm when the training loop computed it (a tensor
        or a number; clip_grad_norm_'s return, Megatron's reported norm); then the monitor does
        not read the gradients for it. ``iteration``: the capture iteration of this step when
        the loop numbers it itself; else the process-wide capture saver's iteration is read.
        """
        b = self._buffers
        if b is None:   # no model: buffers where the loss lives (no transfer per step)
            self._alloc(loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu"), 0)
            b = self._buffers
            assert b is not None
        slot = self._pending
        if isinstance(loss, torch.Tensor):
            b["loss"][slot].copy_(loss.detach().float().mean() if loss.numel() != 1 else loss.detach().reshape(()))
        else:
            b["loss"][slot] = float(loss) if loss is not None else float("nan")
        self._slot_given[slot] = None
        if grad_norm is not None:
            self._take_grad_norm(slot, grad_norm)
        measured = grad_norm is not None
        if self.model is not None and (self._collect or (
                not measured and (self.step + 1) % self.grad_norm_every == 0)):
            self._grad_norms(slot, per_layer=self._collect, keep_global=measured)
            measured = True
        self._slot_gnorm[slot] = measured
        if self._collect and self.model is not None:
            self._finish_stats(slot)
        self._slot_has_stats[slot] = self._collect and self.model is not None
        self._slot_iteration[slot] = int(iteration) if iteration is not None else _capture_iteration()
        self.step += 1
        self._pending += 1
        if self._pending == self.sync_every:
            self.sync()
        # Hooks record during the next step when it is a statistics step, or every step after a
        # non-finite loss was seen (to name the layer where it starts); they are installed only
        # then, so other steps run the model at full speed.
        self._collect = (self.step + 1) % self.layer_stats_every == 0 or self._nonfinite_seen
        if self.model is not None and self._collect:
            self._hooks_on()
        elif self._handles:
            self._hooks_off()

    def _take_grad_norm(self, slot: int, grad_norm: Any) -> None:
        """The loop's global norm: a tensor stays on its device, a number on the host."""
        if not self._grad_norm_given:   # the norm exists every step: judge it at that cadence
            self._grad_norm_given = True
            self._cadence["grad_norm"] = 1
            if self.th_gnorm.step == 0:
                self.thresholds["grad_norm"] = self._new_threshold(
                    next(s for s in SIGNALS if s.name == "grad_norm"))
        if isinstance(grad_norm, torch.Tensor):
            assert self._buffers is not None
            self._buffers["gnorm"][slot, 0].copy_(grad_norm.detach().float().reshape(()))
        else:
            self._slot_given[slot] = float(grad_norm)

    def _grad_norms(self, slot: int, per_layer: bool, keep_global: bool) -> None:
        """Global (and on statistics steps per-layer) gradient norms into the slot's row."""
        assert self._buffers is not None
        grads = [p.grad for p in self._params]
        row = self._buffers["gnorm"][slot]
        if grads and all(g is not None for g in grads):
            norms = torch.stack(torch._foreach_norm(grads))
            idx = self._param_layer
        else:
            keep = [(g, j) for g, j in zip(grads, self._param_layer_host) if g is not None]
            norms = torch.stack(torch._foreach_norm([g for g, _ in keep])) if keep else None
            idx = torch.tensor([j for _, j in keep], dtype=torch.long).to(row.device)
        if norms is None:   # no gradients this step (not the same as NaN gradients)
            (row[1:] if keep_global else row).fill_(-1.0)
            return
        sq = norms.float().square()
        if per_layer:
            row[1:].zero_()
            row[1:].index_add_(0, idx, sq)
            row[1:].sqrt_()
        if not keep_global:
            row[0] = sq.sum().sqrt()

    def _finish_stats(self, slot: int) -> None:
        """All layers' statistics rows from the scratch buffer in one batched pass."""
        assert self._buffers is not None
        if self._bounds_dirty:
            self._bounds_dev.copy_(torch.from_numpy(self._bounds).float().unsqueeze(-1))
            self._bounds_dirty = False
        N = self.sample_size
        a = self._scratch[..., :N].abs()
        over, tiny = self._bounds_dev[0], self._bounds_dev[1]
        absmax = torch.maximum(self._scratch[..., N + 1], -self._scratch[..., N])
        n_over = (a >= over).sum(-1)                    # integer sums: cheaper than float32
        n_under = ((a < tiny) & (a > 0)).sum(-1)        # ones on CPU; zeros (padding) excluded
        torch.stack((absmax, n_over.float(), n_under.float(), a.sum(-1)),
                    dim=-1, out=self._buffers["stats"][slot])
        self._scratch.zero_()
        self._slot_counts[slot] = self._n
        self._n[:] = 0

    def sync(self) -> None:
        """Copy the buffered numbers to the host (one transfer each) and judge them."""
        n, self._pending = self._pending, 0
        if n == 0 or self._buffers is None:
            return
        host = {k: v[:n].cpu().numpy().astype(np.float64) for k, v in self._buffers.items()}
        first_step = self.step - n + 1
        has_norm = self.model is not None or self._grad_norm_given
        for r in range(n):
            row: dict[str, Any] = {"loss": host["loss"][r], "iteration": self._slot_iteration[r]}
            if has_norm:
                g = host["gnorm"][r] if self._slot_gnorm[r] else np.array([-1.0])
                if self._slot_given[r] is not None:
                    g = g.copy()
                    g[0] = self._slot_given[r]
                row["gnorm"] = g if self._slot_has_stats[r] else g[:1]
            if self._slot_has_stats[r]:
                row["stats"] = _stats_rows(host["stats"][r], self._slot_counts[r])
            self._judge(first_step + r, row)
        for s in self.sinks:
            s.flush()

    def _judge(self, step: int, row: dict[str, Any]) -> None:
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

    def _alert(self, alerts: list[dict[str, Any]], view: _StepView, sig: Signal, value: float,
               th: AdaptiveThreshold | None, idx: int = 0, note: str = "") -> None:
        """One alert record; a per-layer one names the layer and the tensor that crossed, and
        points at the captured files of that layer and iteration when capture saved them."""
        step, metric = view.step, sig.name
        layer = self.layers[idx] if sig.per_layer else None
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
        capture = self._capture_link(idx, view.iteration) if layer is not None else None
        if capture is not None:
            msg += f" | capture: {capture['dir']}/{capture['glob']} (iteration {capture['iteration']})"
        alerts.append({"kind": "alert", "step": step, "metric": metric, "value": value,
                       "layer": layer, "tensor": tensor, "baseline_mean": base_mean,
                       "baseline_std": base_std, "deviation": dev, "iteration": view.iteration,
                       "capture": capture, "message": msg})

    def _capture_link(self, idx: int, iteration: int | None) -> dict[str, Any] | None:
        """Where the captured files of watched layer ``idx`` at ``iteration`` are: the capture
        directory, the iteration, a glob of that layer's files (this rank) built by the capture
        schema, and the module path the manifest records carry. None when the process-wide
        capture saved nothing at that iteration."""
        mod = sys.modules.get("tensor_capture.saver")
        saver = mod.current_saver() if mod is not None else None
        if iteration is None or saver is None or iteration not in saver.saved_iterations:
            return None
        from tensor_capture import ranks, schema, sites

        if self._capture_sites is None:   # capture's own module paths and 0-based layer index
            assert self.model is not None
            sites.register_model(self.model)
            self._capture_sites = {i: (sites.site_of(m).module_path, sites.site_of(m).layer_idx)
                                   for i, m in enumerate(self._modules)}
        path, layer_idx = self._capture_sites[idx]
        return {"dir": str(saver.directory), "iteration": iteration, "module_path": path,
                "layer_idx": layer_idx,
                "glob": schema.filename_glob(iteration=iteration, layer_idx=layer_idx,
                                             rank=ranks.global_rank())}

    def _judge_nonfinite(self, sig: Signal, view: _StepView, value: Any,
                         alerts: list[dict[str, Any]]) -> None:
        """Non-finite values need no baseline; per layer, the first such layer is named."""
        if sig.per_layer:
            bad = ~np.isfinite(value)
            if not bad.any():
                return
            i = int(np.argmax(bad))
            value = float(value[i])
        elif math.isfinite(value):
            return
        else:
            i = 0
        self._nonfinite_seen = True
        self._alert(alerts, view, sig, value, None, idx=i,
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
            self._alert(alerts, view, sig, v, th, idx=int(i), note=note)

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
    tuple whose first item is the loss). A dict may also carry "grad_norm" (the global gradient
    norm the loop computed, e.g. clip_grad_norm_'s return: then it is judged every step at no
    cost) and "iteration" (the capture iteration, for loops that number it themselves). With
    ``model=`` (or when the step's first argument is an nn.Module) per-layer statistics are
    watched too. The monitor is ``step_fn.monitor``; call ``step_fn.monitor.close()`` at the
    end to judge the last buffered steps. Other keyword arguments go to
    :class:`TrainingMonitor` (log_every, sync_every, layer_stats_every, grad_norm_every,
    watch_dtype, rolling, sinks, layer_filter, overflow_margin, on_alert, cooldown, sample_size).
    """
    def decorate(f: Callable) -> Callable:
        monitor = TrainingMonitor(warmup_steps=warmup_steps, alert_window=alert_window, sigma=sigma,
                                  model=model, **kwargs)

        @functools.wraps(f)
        def wrapper(*args: Any, **kw: Any) -> Any:
            if monitor.model is None and args and isinstance(args[0], torch.nn.Module):
                monitor.attach(args[0])
            result = f(*args, **kw)
            extra = result if isinstance(result, dict) else {}
            monitor.step_end(_loss_of(result), grad_norm=extra.get("grad_norm"),
                             iteration=extra.get("iteration"))
            return result

        wrapper.monitor = monitor  # type: ignore[attr-defined]
        return wrapper

    return decorate(fn) if fn is not None else decorate
