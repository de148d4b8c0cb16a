import torch


def sliced_attention(query, key, value, scale, upcast):
    query_slice, key_slice = query, key
    if upcast:
        query_slice = query.float()
        key_slice = key.float()
    scores = torch.baddbmm(torch.empty(1), query, key.transpose(-1, -2), beta=0, alpha=scale)
    probs = scores.softmax(dim=-1)                   # finding: the float32 copies are never used
    return torch.bmm(probs.to(value.dtype), value)
