"""mask-value-overflows-low-precision: a float32 bias holding float32's minimum is cast to the
autocast dtype, where that value is -inf and fully padded rows turn NaN (bug olmo-attn-bias-downcast-inf)."""
import torch
from torch.nn import functional as F


def attend(q, k, v, pad: torch.Tensor):
    bias = torch.zeros(pad.shape, dtype=torch.float32, device=q.device)
    bias = bias.masked_fill(pad, torch.finfo(torch.float32).min)  # expect: AMP011
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))


def block(x, wq, wk, wv, pad):
    with torch.autocast("cuda", dtype=torch.float16):
        return attend(x @ wq, x @ wk, x @ wv, pad)
