"""precision-sensitive-op-under-autocast: integer positions go through a matmul inside bf16 autocast,
where positions above 256 lose their exact value (bugs diffusers-rope-positions-under-autocast,
speechbrain-features-under-autocast, imagen-t5-under-fp16-autocast)."""
import torch
from torch import nn


class RotaryAngles(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, positions):
        freqs = positions[:, None].float() @ self.inv_freq[None, :]  # expect: AMP020
        return freqs.cos(), freqs.sin()


def step(model, rope, tokens, positions):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(tokens, *rope(positions))
