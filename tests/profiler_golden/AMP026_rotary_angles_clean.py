import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotary tables for a model that runs in bfloat16, with positions and angles in float32."""

    def __init__(self, dim, base=10000, precision=torch.bfloat16):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))
        self.precision = precision

    def forward(self, x, seq_dim=1):
        t = torch.arange(x.shape[seq_dim], device=x.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())
        return freqs.cos().type_as(x), freqs.sin().type_as(x)


def apply_rotary(freqs, t):
    freqs = freqs[-t.shape[-2]:].to(t.device)
    t1, t2 = t.chunk(2, dim=-1)
    rotated = torch.cat((-t2, t1), dim=-1)
    return t * freqs.cos().to(t) + rotated * freqs.sin().to(t)
