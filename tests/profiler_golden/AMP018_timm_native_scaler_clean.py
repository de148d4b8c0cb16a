import torch
import torch.nn.functional as F
from timm.utils import NativeScaler


def train(model, loader, optimizer, epochs, path):
    loss_scaler = NativeScaler()          # timm's GradScaler wrapper: it holds the loss scale
    for epoch in range(epochs):
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss_scaler(loss, optimizer, parameters=model.parameters())
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "scaler": loss_scaler.state_dict()}, path)
