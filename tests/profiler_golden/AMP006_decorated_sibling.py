"""Our own case: a module that decorates one Function and not the other, which is not called
under autocast here: the undecorated one is reported at low confidence."""
import torch

import scan_cuda


class ScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A):               # low: its sibling is decorated
        ctx.save_for_backward(u, delta, A)
        return scan_cuda.fwd(u, delta, A)

    @staticmethod
    def backward(ctx, dout):                     # low: as forward
        u, delta, A = ctx.saved_tensors
        return scan_cuda.bwd(u, delta, A, dout)


class InnerFn(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, w):
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g):
        return g, g
