"""Our own case: an orthogonal adapter builds its identity on the input's device but in float32,
and multiplies it into a half-precision base weight."""
import torch
from torch import nn


class RotatedLinear(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base
        self.angle = nn.Parameter(torch.zeros(base.in_features, base.in_features))

    def forward(self, x):
        rotation = torch.eye(self.base.in_features, device=x.device) + self.angle
        weight = self.base.weight @ rotation
        return x @ weight.t()
