import torch
import torch.nn.functional as F
from vocoder.utils.io import save_checkpoint


def train(model, loader, optimizer, path):
    scaler = torch.amp.GradScaler("cuda")
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if step % 1000 == 0:
            save_checkpoint(model, optimizer, step, path, scaler=scaler)
