"""The clean twin: both paths upcast the parameter before exp."""
import torch
from torch import nn


class DecayLayer(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.log_decay = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        decay = -torch.exp(self.log_decay.float())
        return (x.float() * decay).to(x.dtype)

    def step(self, x):
        decay = -torch.exp(self.log_decay.float())
        return (x.float() * decay).to(x.dtype)
