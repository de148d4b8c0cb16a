import torch


class PositionalAttention(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.eps = 1e-6
        self.register_buffer("table", torch.linspace(0, 1, dim).to("cpu"))   # no finding: construction

    def positions(self, h, like):
        idx = torch.linspace(0, h - 1, h, dtype=like.dtype, device=like.device)   # no finding
        return idx.view(h, 1)

    def future_mask(self, x):
        n = x.size(0)
        return torch.triu(torch.full([n, n], float("-inf")), 1).to(x)   # no finding: dtype and device

    def linear_attention(self, query, key, value):
        scores = torch.matmul(query, key.transpose(-1, -2)).to(dtype=torch.float32)
        scores = scores / (scores.sum(dim=2, keepdim=True) + self.eps)
        return torch.matmul(value, scores.to(value.dtype))   # no finding: cast back

    def forward(self, x):
        pos = self.positions(x.size(1), x)
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
        self.k = self.k.to(k.dtype)                       # no finding: the cache follows the keys
        return self.k.index_copy_(2, input_pos, k)


class Embeddings(torch.nn.Module):
    def __init__(self, n, dim):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(n, dim))

    def forward(self, ids):
        noise = torch.randn(ids.numel(), 4).to(device=ids.device).to(dtype=self.table.dtype)   # no finding
        return self.table[ids] + noise.sum()
