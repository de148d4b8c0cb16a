import torch


class LinearAttention(torch.nn.Module):
    def forward(self, q, k, v):
        q, k = q.softmax(dim=-1, dtype=torch.float32), k.relu()
        with torch.autocast("cuda", enabled=False):
            context = k.float().transpose(-2, -1) @ v.float()   # no finding: summed in float32
            normaliser = k.float().sum(dim=-2)
        out = torch.einsum("bhnd,bhde->bhne", q, context)
        return (out / torch.einsum("bhnd,bhd->bhn", q, normaliser).unsqueeze(-1)).type_as(v)


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1)                 # no finding: softmax attention sums a head dim
        return scores.softmax(dim=-1, dtype=torch.float32).type_as(v) @ v


def train(model, loader, optimizer, scaler):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = (model(x, x, x) - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
