import torch
from torch.autograd import Function

from . import _blur_ext as ext  # a compiled kernel


class WarpBlur(Function):
    @staticmethod
    def forward(ctx, image, flow, gate, kernel, order):
        # `order` is an integer index (backward gives it no gradient): it keeps its dtype
        # the kernel reads every operand as one type: bring them to the flow's dtype
        image = image.type_as(flow)
        kernel = kernel.to(dtype=flow.dtype)
        out = image.new_empty(image.shape)
        ext.warp_blur_forward(image, flow, gate, kernel, order, out)
        ctx.save_for_backward(image, flow, gate, kernel)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        image, flow, gate, kernel = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in (image, flow, gate, kernel)]
        ext.warp_blur_backward(grad_out, image, flow, gate, kernel, *grads)
        return grads[0], grads[1], grads[2], grads[3], None
