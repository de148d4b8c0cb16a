"""low-precision-reduction: statistics of a half-precision input reduced in half precision; the
dtype is chosen by whoever builds the model (bugs detectron2-syncbn-half-stats, litgpt-rmsnorm-low-precision)."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        mean_sq = torch.mean(x * x, dim=-1, keepdim=True)  # expect: AMP016
        return self.weight * x * torch.rsqrt(mean_sq + self.eps)


def build(dim: int, dtype: torch.dtype = torch.bfloat16):
    return nn.Sequential(nn.Linear(dim, dim), RMSNorm(dim)).to(dtype=dtype)
