# Pure inference in half precision: no autocast and no GradScaler, so AMP001 stays quiet.
import torch

model = torch.nn.Linear(8, 8).half()
with torch.no_grad():
    out = model(torch.randn(2, 8).half())
