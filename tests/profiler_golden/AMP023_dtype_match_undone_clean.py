"""The clean twin: the mask is matched after the recast, so it follows the float16 q."""
import torch


def sparse_attention(q, k, v, att_mask, kernel):
    q_dtype = q.dtype
    q, k, v = q.half(), k.half(), v.half()  # amp-check: ignore[AMP001]
    if att_mask is not None and att_mask.dtype != q.dtype:
        att_mask = att_mask.to(q.dtype)
    scores = kernel.sdd(q, k)
    probs = kernel.softmax(scores, attn_mask=att_mask)
    return kernel.dsd(probs, v).to(q_dtype)
