# bfloat16 autocast does not need a GradScaler.
import torch


def train(model, loader, opt):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
