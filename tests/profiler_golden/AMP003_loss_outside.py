import torch
import torch.nn.functional as F
from torch.amp import GradScaler, autocast


def train_step(model, criterion, x, y, opt, scaler: GradScaler):
    with autocast("cuda"):
        logits = model(x)
    loss = criterion(logits, y)                  # finding
    aux = F.cross_entropy(logits.float(), y)     # finding: still outside (the .float() is not seen)
    scaler.scale(loss + aux).backward()


def good_step(model, criterion, x, y, scaler):
    with autocast("cuda"):
        logits = model(x)
        loss = criterion(logits, y)
    scaler.scale(loss).backward()
    metric = criterion(x, y)                     # no finding: inputs not produced under autocast
