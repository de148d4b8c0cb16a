import torch


def attention(q, k, v):
    scores = q.half() @ k.half().transpose(-2, -1)   # finding x2: casts in code nobody trains here
    probs = torch.softmax(scores, dim=-1)            # finding: softmax on float16 scores
    total = scores.sum()                             # finding: float16 reduction
    return probs @ v.half(), total                   # finding: cast


class Square(torch.autograd.Function):               # finding x2: no custom_fwd/custom_bwd
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def head(p, y):
    return torch.nn.functional.binary_cross_entropy(p, y)   # finding: raises under autocast
