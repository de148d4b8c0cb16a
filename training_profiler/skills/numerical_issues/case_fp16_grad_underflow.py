"""Case 3: fp16 training without loss scaling — small gradients flush to zero.

The model is cast with ``.half()`` and trained without a GradScaler: gradients below fp16's
smallest subnormal (~6e-8) become exactly zero and those weights stop learning.
Detected by: the static checker (AMP008 fp16-without-gradscaler on this very file) and, at run
time, ``@watch_training(watch_dtype=torch.float16)`` reporting the underflow ratio of gradients.

    python -m training_profiler.skills.numerical_issues.case_fp16_grad_underflow
"""
from __future__ import annotations

import torch


def fp16_gradient_zero_fraction(seed: int = 0) -> float:
    """Fraction of nonzero fp32 gradients that are exactly zero once computed in fp16."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(256, 256)
    x = torch.randn(32, 256)
    loss = model(x).pow(2).mean() * 1e-6  # a small loss, as after many steps of training
    loss.backward()
    g32 = model.weight.grad.clone()
    half = torch.nn.Linear(256, 256).half()  # the mistake: fp16 parameters, no GradScaler
    half.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(half.parameters(), lr=1e-3)
    loss16 = half(x.half()).float().pow(2).mean() * 1e-6
    loss16.backward()
    g16 = half.weight.grad.float()
    opt.step()  # the update these zeros feed: those weights do not move
    nonzero = g32 != 0
    return ((g16 == 0) & nonzero).float().sum().item() / max(int(nonzero.sum()), 1)


def run() -> float:
    return fp16_gradient_zero_fraction()


if __name__ == "__main__":
    print(f"gradients flushed to zero in fp16: {run():.1%}")
