import torch


class PositionalAttention(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.eps = 1e-6

    def positions(self, h, device):
        idx = torch.linspace(0, h - 1, h).to(device)     # finding: float32, device only
        return idx.view(h, 1)

    def future_mask(self, x):
        n = x.size(0)
        return torch.triu(torch.full([n, n], float("-inf")), 1).to(device=x.device)   # finding

    def linear_attention(self, query, key, value):
        scores = torch.matmul(query, key.transpose(-1, -2)).to(dtype=torch.float32)
        scores = scores / (scores.sum(dim=2, keepdim=True) + self.eps)
        return torch.matmul(value, scores)               # finding: float32 scores, half values

    def forward(self, x):
        pos = self.positions(x.size(1), x.device)
        return self.linear_attention(x, x, self.proj(x)) + pos + self.future_mask(x)


def train(loader, hub):
    model = hub.from_pretrained("attention-checkpoint", torch_dtype=torch.float16)   # runs in float16
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in loader:
        model(x).float().mean().backward()
        opt.step()


class KVCache(torch.nn.Module):
    def __init__(self, shape, dtype=None):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)

    def forward(self, input_pos, k):
        return self.k.index_copy_(2, input_pos, k)       # finding: the buffer keeps its dtype
