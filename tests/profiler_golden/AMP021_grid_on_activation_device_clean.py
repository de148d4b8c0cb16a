"""The clean twin: the identity is made in the input's dtype as well as on its device."""
import torch
from torch import nn


class RotatedLinear(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base
        self.angle = nn.Parameter(torch.zeros(base.in_features, base.in_features))

    def forward(self, x):
        rotation = torch.eye(self.base.in_features, device=x.device, dtype=x.dtype) + self.angle
        weight = self.base.weight @ rotation
        return x @ weight.t()
