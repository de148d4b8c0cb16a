"""The thresholds of ``@watch_training``: the settings that decide what is anomalous
(:class:`MonitorThresholds`) and the learnt baseline each signal is judged against
(:class:`AdaptiveThreshold`).

Why adaptive: users do not know whether a gradient norm of 100 is an explosion, so the first
``warmup_steps`` values establish a baseline (mean, std, min, max) and later values are judged
against it (mean ± sigma·std, and the range doubling: above 2·max / below min/2). With
``rolling=True`` the mean/std come from the last ``alert_window`` normal values, so a slowly
improving loss does not alarm, while the range check against the warm-up keeps slow drifts
visible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tensor_capture.adaptive import AdaptiveThreshold  # the one definition (re-exported)


@dataclass(frozen=True)
class MonitorThresholds:
    """What the monitor calls anomalous; one value per run, shared by every signal.

    ``warmup_steps`` / ``alert_window`` count steps; a signal measured every k steps (the
    per-layer statistics) warms up and rolls over proportionally fewer of its own values.
    ``overflow_margin`` scales the watched dtype's overflow bound; ``watch_dtype`` judges the
    ranges against that dtype instead of each tensor's own. ``cooldown``: steps within which a
    repeat of the same alert (metric and layer) is kept but not printed.
    """

    warmup_steps: int = 100
    alert_window: int = 50
    sigma: float = 3.0
    rolling: bool = True
    overflow_margin: float = 1.0
    watch_dtype: torch.dtype | None = None
    cooldown: int = 10

    def adaptive(self, every: int, **settings: Any) -> "AdaptiveThreshold":
        """The AdaptiveThreshold of a signal with one value every ``every`` steps;
        ``settings``: the signal's own keywords (direction, range check, floors)."""
        warm = self.warmup_steps if every == 1 else max(2, self.warmup_steps // every)
        window = None
        if self.rolling:
            window = self.alert_window if every == 1 else max(2, self.alert_window // every)
        return AdaptiveThreshold(warm, self.sigma, window, **settings)
