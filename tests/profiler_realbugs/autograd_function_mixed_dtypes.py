"""autograd-function-mixed-dtypes: a custom Function gets an fp16 offset from an autocast conv and
an fp32 input, with no custom_fwd to align them; autocast is held in a variable (bug mmcv-dcn-autocast-dtypes)."""
import torch
from torch import nn


class ShiftSample(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offset):  # expect: AMP006
        ctx.save_for_backward(x, offset)
        return torch.ops.myops.shift_sample(x, offset)

    @staticmethod
    def backward(ctx, grad):  # expect: AMP006
        x, offset = ctx.saved_tensors
        return torch.ops.myops.shift_sample_backward(grad, x, offset)


def forward_step(conv: nn.Conv2d, x):
    amp = torch.autocast("cuda", dtype=torch.float16)
    with amp:
        return ShiftSample.apply(x, conv(x))
