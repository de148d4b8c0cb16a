"""A fused activation written as a custom autograd Function, used under fp16 autocast."""
import torch
import torch.nn as nn


class FusedGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # expect: AMP006
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + torch.tanh(0.79788456 * (x + 0.044715 * x ** 3)))

    @staticmethod
    def backward(ctx, grad):  # expect: AMP006
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * (x + 0.044715 * x ** 3))
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.79788456 * (1 + 0.134145 * x * x))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(FusedGeLU.apply(self.up(x)))


def train(model, data, opt):
    for x, y in data:
        with torch.autocast("cuda"):  # expect: AMP008
            out = model(x)
            loss = nn.functional.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
