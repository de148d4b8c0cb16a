import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision


def train(model, loader, optimizer):
    model = FullyShardedDataParallel(model, mixed_precision=MixedPrecision(param_dtype=torch.float16))
    scaler = torch.amp.GradScaler("cuda")            # finding: checks only this rank's shard
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
