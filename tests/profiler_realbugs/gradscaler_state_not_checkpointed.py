"""gradscaler-state-not-checkpointed: checkpoints keep model and optimizer but not the loss scale,
so a resumed fp16 run restarts from the initial scale (bug detectron2-scaler-state-not-saved)."""
import torch
from torch.nn import functional as F


def save_checkpoint(path, model, optimizer, epoch):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)  # expect: AMP018


def train(model, loader, optimizer, epochs, path):
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(epochs):
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        save_checkpoint(path, model, optimizer, epoch)
