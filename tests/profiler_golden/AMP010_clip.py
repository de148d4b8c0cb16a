import torch
from torch.nn.utils import clip_grad_norm_


def bad(model, loss, opt, scaler):
    scaler.scale(loss).backward()
    clip_grad_norm_(model.parameters(), 1.0)           # finding
    scaler.step(opt)


def good(model, loss, opt, scaler):
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)


scaler = torch.amp.GradScaler("cuda")
