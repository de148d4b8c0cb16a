"""Our own case: a block-sparse style attention that matches its mask to q's dtype, then
forces q, k and v to float16 for a half-only kernel; the mask stays in the old dtype."""
import torch


def sparse_attention(q, k, v, att_mask, kernel):
    if att_mask is not None and att_mask.dtype != q.dtype:
        att_mask = att_mask.to(q.dtype)
    q_dtype = q.dtype
    q, k, v = q.half(), k.half(), v.half()  # amp-check: ignore[AMP001]
    scores = kernel.sdd(q, k)
    probs = kernel.softmax(scores, attn_mask=att_mask)
    return kernel.dsd(probs, v).to(q_dtype)
