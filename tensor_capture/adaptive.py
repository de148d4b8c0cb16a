"""The adaptive rule that judges a training signal against its own recent past: a warm-up
baseline, a sigma test against a rolling window, and the range doubling.

Why in tensor_capture: the rule has two users that must not disagree, the ``@watch_training``
monitor (training_profiler.monitor.thresholds, which re-exports it) and the flight recorder's
loss / gradient-norm / flush-ratio triggers (tensor_capture.recorder.triggers); capture runs
inside training and may not import the profiler, so the one definition lives here.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


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
