"""A GradScaler passed in, or held by a wrapper, is still a GradScaler."""
import time

import torch


def train_step(model, x, y, optimizer, scaler, criterion):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = criterion(model(x), y)
    scaler.scale(loss).backward()                    # no AMP008: the scaler is recognised by use
    scaler.step(optimizer)
    scaler.update()


def time_backward(model, x):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda"):
        out = model(x).float().sum()
    out.backward()                                   # no AMP008 / AMP009: a profiling helper
    torch.cuda.synchronize()
    return time.perf_counter() - t0
