import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        ms = torch.mean(x * x, dim=-1, keepdim=True)           # finding: squares in float16
        return self.weight * x * torch.rsqrt(ms + self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        var = x.var(dim=-1, unbiased=False, keepdim=True)       # finding: eps 1e-5 is subnormal in float16
        return (x - x.mean(dim=-1, keepdim=True)) * (var + self.eps).rsqrt()


class AdaptiveEpsNorm(nn.Module):
    def forward(self, x):
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        var = torch.var(x, dim=-1, unbiased=False, keepdim=True)   # no finding: eps follows the dtype
        return (x - x.mean(dim=-1, keepdim=True)) * (var + eps).rsqrt()


class SafeRMSNorm(nn.Module):
    def forward(self, x):
        h = x.float()
        ms = h.pow(2).mean(-1, keepdim=True)                    # no finding: float32 statistics
        return (h * torch.rsqrt(ms + 1e-6)).type_as(x)


class Pool(nn.Module):
    def forward(self, x):
        return x.mean(dim=1)                                    # no finding: not a normalization


model = nn.Sequential(nn.Linear(8, 8), RMSNorm(8), LayerNorm(8)).half()
