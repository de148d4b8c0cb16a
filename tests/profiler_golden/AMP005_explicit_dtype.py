import torch
import torch.nn.functional as F


def step(model, x, y, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        loss = F.cross_entropy(logits, y)
    confidence = probs.sum()                         # no finding: softmax made it float32
    mean_logit = logits.mean(dtype=torch.float32)    # no finding: reduced in float32
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return confidence, mean_logit
