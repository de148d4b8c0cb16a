import torch
import torch.nn.functional as F

with torch.autocast("cpu", dtype=torch.bfloat16):
    h = torch.randn(4, 8) @ torch.randn(8, 8)
    a = F.softmax(h, dim=-1)                             # finding: CPU autocast keeps bf16
    b = h.log_softmax(-1)                                # finding
    c = F.softmax(h, dim=-1, dtype=torch.float32)        # no finding
with torch.autocast("cuda"):
    d = torch.softmax(torch.randn(4, 8, device="cuda"), -1)   # no finding: CUDA autocast promotes
e = torch.softmax(h, dim=-1)                             # finding: h escaped the autocast block
