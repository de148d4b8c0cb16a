import torch


def attention(q, k, v):
    scores = q @ k.transpose(-2, -1)                 # no finding: the caller's precision, no cast
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(v)
    total = scores.sum(dtype=torch.float32)
    return probs @ v, total


class Square(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def head(logits, y):
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
