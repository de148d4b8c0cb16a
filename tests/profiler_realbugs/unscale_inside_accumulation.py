"""unscale-inside-accumulation: unscale_ on every micro-batch, step only every `accum` (bug timm-unscale-every-microstep)."""
import torch
from torch.nn import functional as F


def train_epoch(model, loader, optimizer, scaler, accum, max_norm):
    for i, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y) / accum
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # expect: AMP013
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if (i + 1) % accum == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
