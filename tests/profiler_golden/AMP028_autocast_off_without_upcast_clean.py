import torch
import torch.nn.functional as F


class Codebook(torch.nn.Module):
    def __init__(self, n, dim):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(n, dim))

    @torch.autocast("cuda", enabled=False)
    def forward(self, x):
        x = x.float()
        dist = torch.cdist(x, self.embed)
        return dist.argmin(dim=-1)


def train(model, head, loader, optimizer, scaler):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            codes = model(head(x))
            loss = F.cross_entropy(codes.float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
