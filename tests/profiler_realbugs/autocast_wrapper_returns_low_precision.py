"""autocast-wrapper-returns-low-precision: a helper wraps forward in autocast and hands back
float16 outputs, so the caller's loss runs in float16 (bug accelerate-fp16-outputs-leak)."""
import torch
from torch.nn import functional as F


def prepare(model, fp16: bool):
    if fp16:
        model.forward = torch.autocast("cuda", dtype=torch.float16)(model.forward)  # expect: AMP014
    return model


def train_step(model, x, y, optimizer, scaler):
    logits = prepare(model, fp16=True)(x)
    loss = F.cross_entropy(logits, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
