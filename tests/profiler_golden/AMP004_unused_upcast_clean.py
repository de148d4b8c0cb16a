import torch


def sliced_attention(query, key, value, scale, upcast):
    if upcast:
        query = query.float()
        key = key.float()
    scores = torch.baddbmm(torch.empty(1), query, key.transpose(-1, -2), beta=0, alpha=scale)
    probs = scores.softmax(dim=-1)                   # no finding: the upcast tensors are used
    return torch.bmm(probs.to(value.dtype), value)
