"""A model file on its own: nothing here trains."""
import torch


def attention(q, k, v):
    scores = q.half() @ k.half().transpose(-2, -1)   # seed: AMP001
    probs = torch.softmax(scores, dim=-1)            # seed: AMP004
    return probs @ v.to(torch.float16)               # seed: AMP001


class ScaledGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):                             # seed: AMP006
        ctx.save_for_backward(x)
        return torch.nn.functional.gelu(x) * 2

    @staticmethod
    def backward(ctx, g):                            # seed: AMP006
        (x,) = ctx.saved_tensors
        return g * 2
