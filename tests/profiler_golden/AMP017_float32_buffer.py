import torch
from torch.autograd import Function

import interp_ext


class Interpolate(Function):
    @staticmethod
    def forward(ctx, features, idx, weight):
        b, c, n = features.size(0), features.size(1), idx.size(1)
        out = torch.cuda.FloatTensor(b, c, n)                                   # finding
        tmp = torch.zeros(b, c, n, dtype=torch.float32, device=features.device) # finding
        interp_ext.forward(features, idx, weight, out, tmp)
        return out

    @staticmethod
    def backward(ctx, grad):
        g = grad.new_zeros(grad.shape)                                          # no finding: follows the input
        interp_ext.backward(grad, g)
        return g, None, None
