"""Our own case: a state-space layer exponentiates its log-parameterised decay in float32 in
its one-token step, and in the parameter's own dtype in its full forward."""
import torch
from torch import nn


class DecayLayer(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.log_decay = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        decay = -torch.exp(self.log_decay)
        return x * decay

    def step(self, x):
        decay = -torch.exp(self.log_decay.float())
        return (x.float() * decay).to(x.dtype)
