"""Mixed precision set up in one module, used in another (project-mode golden case)."""
from contextlib import nullcontext

import torch


class LossScaler:
    """Wraps a GradScaler: calling it scales, unscales before clipping, steps and updates."""

    def __init__(self) -> None:
        self._scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip=None, params=None):
        self._scaler.scale(loss).backward()
        if clip is not None:
            self._scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, clip)
        self._scaler.step(optimizer)
        self._scaler.update()


def autocast_for(device: str, enabled: bool):
    return torch.autocast(device, dtype=torch.float16) if enabled else nullcontext()
