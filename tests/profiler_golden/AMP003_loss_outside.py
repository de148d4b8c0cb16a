import torch
import torch.nn.functional as F
from torch.amp import GradScaler, autocast


def train_step(model, criterion, x, y, opt, scaler: GradScaler):
    with autocast("cuda"):
        logits = model(x)
    loss = criterion(logits, y)                  # finding
    aux = F.cross_entropy(logits.view(-1, 10), y)  # finding: a view is still float16
    ok = F.cross_entropy(logits.float(), y)      # no finding: .float() hands the loss float32
    scaler.scale(loss + aux + ok).backward()


def good_step(model, criterion, x, y, scaler):
    with autocast("cuda"):
        logits = model(x)
        loss = criterion(logits, y)
    scaler.scale(loss).backward()
    metric = criterion(x, y)                     # no finding: inputs not produced under autocast
