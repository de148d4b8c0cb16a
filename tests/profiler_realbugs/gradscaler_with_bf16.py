"""gradscaler-with-bf16: loss scaling kept on although every autocast region is bfloat16 (bug accelerate-gradscaler-under-bf16)."""
import torch
from torch.nn import functional as F

AMP_DTYPE = torch.bfloat16
scaler = torch.amp.GradScaler("cuda")  # expect: AMP015


def train_step(model, x, y, optimizer):
    with torch.autocast("cuda", dtype=AMP_DTYPE):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
