"""The clean twin: both forwards hand the float32 layers an input in their dtype."""
import torch
from torch import nn


class Adapter(nn.Module):
    def __init__(self, base, r):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, r, bias=False)
        self.up = nn.Linear(r, base.out_features, bias=False)

    def forward(self, x):
        result = self.base(x)
        return result + self.up(self.down(x.to(self.down.weight.dtype))).to(result.dtype)


class QuantizedAdapter(Adapter):
    def forward(self, x):
        result = self.base(x)
        if x.dtype != torch.float32:
            x = x.float()
        return result + self.up(self.down(x)).to(result.dtype)
