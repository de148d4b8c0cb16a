import torch
from torch import nn

model = nn.Linear(8, 8).cuda().half()          # finding: model cast in AMP code
scaler = torch.amp.GradScaler("cuda")
x = torch.randn(4, 8).to(torch.float16)        # finding: input cast
y = torch.randn(4, 8).to(device="cuda", dtype=torch.bfloat16)  # finding
z = torch.randn(4, 8).type(torch.cuda.HalfTensor)  # finding
w = torch.randn(4, 8).to("cuda")               # no finding: device move only
v = torch.randn(4, 8).float()                  # no finding: float32
u = x.half()  # amp-check: ignore[AMP001]
with torch.autocast("cuda"):
    out = model(x)
scaler.scale(out.float().sum()).backward()     # a training step: the casts above are training casts
