from contextlib import suppress
from functools import partial

import torch
import torch.nn.functional as F


def train_one_epoch(model, loader, optimizer, scaler, amp_autocast=suppress):
    for x, y in loader:
        with amp_autocast():
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def validate(model, loader, amp_autocast=suppress):
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in loader:
            with amp_autocast():
                logits = model(x)
                total += F.cross_entropy(logits, y).item()   # no finding: autocast runs it in float32
    return total


def main(model, loader, optimizer, use_amp):
    amp_autocast = suppress
    if use_amp:
        amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)
    scaler = torch.amp.GradScaler("cuda")
    train_one_epoch(model, loader, optimizer, scaler, amp_autocast=amp_autocast)
    validate(model, loader, amp_autocast)
