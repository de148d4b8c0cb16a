import torch
from torch import nn


class Rotary(nn.Module):
    """cos/sin tables cached in plain attributes, rebuilt on a new length, device or dtype."""

    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, q):
        n = q.shape[-2]
        if n != self.seq_len_cached or self.cos_cached.device != q.device or self.cos_cached.dtype != q.dtype:
            self.seq_len_cached = n
            freqs = torch.outer(torch.arange(n, device=q.device, dtype=torch.float32), self.inv_freq.float())
            self.cos_cached, self.sin_cached = freqs.cos().to(q.dtype), freqs.sin().to(q.dtype)
        return q * self.cos_cached + q.flip(-1) * self.sin_cached

