import torch


class LinearAttention(torch.nn.Module):
    def forward(self, q, k, v):
        q, k = q.softmax(dim=-1, dtype=torch.float32).type_as(v), k.relu()
        context = k.transpose(-2, -1) @ v                # finding: sums over every token
        normaliser = k.sum(dim=-2)                       # finding: the same sum, unbounded
        out = torch.einsum("bhnd,bhde->bhne", q, context)
        return out / torch.einsum("bhnd,bhd->bhn", q, normaliser).unsqueeze(-1)


def train(model, loader, optimizer, scaler):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = (model(x, x, x) - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
