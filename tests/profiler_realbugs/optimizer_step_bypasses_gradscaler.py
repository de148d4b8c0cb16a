"""optimizer-step-bypasses-gradscaler: the loss is scaled for backward, but the update calls the
optimizer directly, so gradients are never unscaled and overflowing steps are not skipped
(bug lavis-optimizer-step-bypasses-gradscaler)."""
import torch


def train_step(model, batch, optimizer, scaler, use_amp=True):
    with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
        loss = model(batch).float().mean()
    if use_amp:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    optimizer.step()  # expect: AMP010
    optimizer.zero_grad()
