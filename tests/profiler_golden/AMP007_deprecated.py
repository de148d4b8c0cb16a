import torch
from torch.cuda.amp import GradScaler, autocast       # finding (one per import)

scaler = GradScaler()
with autocast():
    pass
with torch.cuda.amp.autocast(dtype=torch.bfloat16):   # finding
    pass
with torch.amp.autocast("cuda"):                      # no finding
    pass
