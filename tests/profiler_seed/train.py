"""A training loop with the seed's two autocast rows."""
import torch
import torch.nn.functional as F


def train(model, loader, optimizer, scaler):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        loss = F.cross_entropy(logits, y)            # seed: AMP003
        margin = logits.mean()                       # seed: AMP005
        scaler.scale(loss + margin).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
