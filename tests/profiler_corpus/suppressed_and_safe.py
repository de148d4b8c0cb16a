"""Deliberate choices that the author suppressed or wrote safely."""
import torch
import torch.nn.functional as F

scaler = torch.amp.GradScaler("cuda")


def step(model, x, y, opt):
    x = x.half()  # amp-check: ignore[AMP001]  (the data pipeline already produces fp16)
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(x)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        att = torch.softmax(logits, dim=-1, dtype=torch.float32)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    total = logits.float().sum()
    return loss, att, total
