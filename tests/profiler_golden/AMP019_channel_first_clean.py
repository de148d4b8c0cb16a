import torch
import torch.nn.functional as F


class LiteLinearAttention(torch.nn.Module):
    """Linear attention in a channel-first layout: q, k, v are (batch, heads, dim, tokens)."""

    def forward(self, q, k, v):
        q, k = F.relu(q), F.relu(k)
        trans_k = k.transpose(-1, -2)
        v = F.pad(v, (0, 0, 0, 1), mode="constant", value=1)
        vk = torch.matmul(v.float(), trans_k.float())
        out = torch.matmul(vk, q.float())
        return out[:, :, :-1] / (out[:, :, -1:] + 1e-15)


def train(model, loader, optimizer, scaler):
    for q, k, v in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(q, k, v).square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
