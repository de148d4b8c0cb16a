"""exp-in-half-precision-overflow: a decay rate is kept as a log parameter and exponentiated in
the parameter's own dtype; in a model loaded in float16 the exponential overflows
(bug mamba-a-log-exp-fp16-overflow)."""
import torch
from torch import nn


class Decay(nn.Module):
    def __init__(self, heads: int):
        super().__init__()
        self.a_log = nn.Parameter(torch.log(torch.arange(1, heads + 1, dtype=torch.float32) * 16))

    def forward(self, x):
        a = -torch.exp(self.a_log)  # expect: none-covers
        return x * a
