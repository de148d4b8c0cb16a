"""Our own case: an adapter whose float32 layers get an upcast input in the quantized variant's
forward and the raw (possibly float16) input in the plain one."""
import torch
from torch import nn


class Adapter(nn.Module):
    def __init__(self, base, r):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, r, bias=False)
        self.up = nn.Linear(r, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class QuantizedAdapter(Adapter):
    def forward(self, x):
        result = self.base(x)
        if x.dtype != torch.float32:
            x = x.float()
        return result + self.up(self.down(x)).to(result.dtype)
