# CPU autocast runs binary_cross_entropy in float32, so it is allowed there.
import torch
import torch.nn.functional as F

with torch.autocast("cpu", dtype=torch.bfloat16):
    p = torch.sigmoid(torch.randn(4))
    loss = F.binary_cross_entropy(p, torch.ones(4))
