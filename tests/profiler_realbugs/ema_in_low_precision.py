"""ema-in-low-precision: a moving average of the weights is stored in the model's float16, where
the small per-step update rounds away (bug onmt-ema-fp16-2023)."""
import torch


class Ema:
    def __init__(self, model, decay: float = 0.9999):
        self.decay = decay
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def update(self, model):
        for avg, p in zip(self.shadow, model.parameters()):
            avg.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)  # expect: none-covers
