"""grads-read-before-unscale: gradient norms are measured right after backward, while the
GradScaler's unscale_ only runs later inside clipping (bug lightning-grad-norm-before-unscale)."""
import torch


def grad_norm(params):
    return torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))


def train_step(model, batch, optimizer, scaler, log, clip=1.0):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch).mean()
    scaler.scale(loss).backward()
    log["grad_norm"] = grad_norm(model.parameters())  # expect: none-covers
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
