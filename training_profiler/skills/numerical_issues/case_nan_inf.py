"""Case 2: NaN/Inf appearing mid-training, and where it starts.

A small model trains normally; at one step a corrupt sample with extreme values arrives, the
first layer's activations overflow to Inf, and the loss becomes NaN.
Detected by: ``@watch_training`` (non-finite loss alert, and the first layer with non-finite
activations named in forward order).

    python -m training_profiler.skills.numerical_issues.case_nan_inf
"""
from __future__ import annotations

import torch

from training_profiler import watch_training

BAD_STEP = 60


def run(steps: int = 80, bad_step: int = BAD_STEP, verbose: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    w = torch.randn(16, 1)

    @watch_training(warmup_steps=30, alert_window=30, model=model, layer_stats_every=1,
                    sinks=["stdout"] if verbose else [], log_every=20)
    def train_step(step: int):
        x = torch.randn(64, 16)
        if step == bad_step:
            x[0] = 3e38  # a corrupt sample: the first layer's output exceeds the float32 range
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, x @ w)
        loss.backward()
        if torch.isfinite(loss):
            opt.step()
        return loss

    for s in range(steps):
        train_step(s)
    train_step.monitor.close()
    return train_step.monitor


if __name__ == "__main__":
    run(verbose=True)
