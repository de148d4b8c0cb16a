import torch

scaler = torch.amp.GradScaler("cuda")
with torch.autocast("cuda"):
    loss = torch.randn(1, requires_grad=True).sum()
    scaler.scale(loss).backward()             # finding
scaler.scale(loss).backward()                 # no finding
