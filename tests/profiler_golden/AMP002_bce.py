import torch
import torch.nn as nn
import torch.nn.functional as F

bce = nn.BCELoss()                              # finding: module built for AMP code
ok = nn.BCEWithLogitsLoss()                     # no finding
with torch.autocast(device_type="cuda", dtype=torch.float16):
    logits = torch.randn(4, 1, device="cuda")
    p = torch.sigmoid(logits)
    l1 = F.binary_cross_entropy(p, torch.ones_like(p))    # finding
    l2 = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))  # no finding
    with torch.autocast("cuda", enabled=False):
        l3 = F.binary_cross_entropy(p.float(), torch.ones_like(p).float())   # no finding: autocast off
