"""backward-inside-autocast: the trainer calls the library's backward (which applies the loss
scale) before leaving the autocast block (bug ddpm-backward-inside-autocast)."""
import torch


def train(model, loader, optimizer, accelerator):
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch).float().mean()
            accelerator.backward(loss)  # expect: AMP009
        optimizer.step()
        optimizer.zero_grad()
