import torch
import torch.nn.functional as F


def optimizer_step(optimizer, loss_scaler, params, noise):
    loss_scaler.unscale_(optimizer)                  # no finding: gradients unscaled first
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for p in params:
        p.grad.add_(torch.randn_like(p.grad) * noise)
    loss_scaler.step(optimizer)
    loss_scaler.update()


def train_epoch(model, loader, optimizer, loss_scaler, noise):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        loss_scaler.scale(loss).backward()
        optimizer_step(optimizer, loss_scaler, list(model.parameters()), noise)


def main(model, loader, optimizer):
    train_epoch(model, loader, optimizer, torch.amp.GradScaler("cuda"), 0.01)
