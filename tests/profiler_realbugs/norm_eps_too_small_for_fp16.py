"""norm-eps-too-small-for-fp16: a normalization eps meant for float32 added in the activations'
float16 (bug imagen-layernorm-eps-fp16)."""
import torch
from torch import nn


class ChannelNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.g = nn.Parameter(torch.ones(1, dim, 1, 1))
        self.eps = eps

    def forward(self, x):
        var, mean = torch.var_mean(x, dim=1, unbiased=False, keepdim=True)
        return (x - mean) * (var + self.eps).rsqrt() * self.g  # expect: none-covers


def step(model, x):
    with torch.autocast("cuda", dtype=torch.float16):
        return model(x)
