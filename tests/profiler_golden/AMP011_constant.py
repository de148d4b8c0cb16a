import torch

scaler = torch.amp.GradScaler("cuda")
with torch.autocast("cuda", dtype=torch.float16):
    scores = torch.randn(2, 4, 4, device="cuda")
    mask = torch.ones(4, 4, dtype=torch.bool, device="cuda").triu(1)
    a = scores.masked_fill(mask, -1e9)                             # finding
    b = scores.masked_fill(mask, torch.finfo(scores.dtype).min)   # no finding
    c = torch.full((2, 2), 70000.0)                                # finding
    d = scores.masked_fill(mask, -1e4)                             # no finding: fits float16
