import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def train(model, loader, optimizer):
    model = FullyShardedDataParallel(model, mixed_precision=MixedPrecision(param_dtype=torch.float16))
    scaler = ShardedGradScaler()                     # all-reduces the inf/NaN check
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
