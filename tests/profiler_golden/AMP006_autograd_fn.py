import torch
from torch.autograd import Function

import my_cuda_ext


class Bad(Function):
    @staticmethod
    def forward(ctx, x, w):                  # finding: a matmul on whatever dtypes autocast gave
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):                    # finding: a compiled kernel reads one scalar type
        x, w = ctx.saved_tensors
        return my_cuda_ext.matmul_backward(g, x, w)


class PassThrough(Function):
    @staticmethod
    def forward(ctx, bias, k, dtype):        # no finding: nothing depends on matching dtypes
        return (bias / k).to(dtype)

    @staticmethod
    def backward(ctx, g):                    # no finding: a pass-through
        return g, None, None


class Good(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, w):
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g):
        return g, g


with torch.autocast("cuda"):
    y = Bad.apply(torch.ones(2, 2), torch.ones(2, 2))
