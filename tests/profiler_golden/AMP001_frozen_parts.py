"""Our own case: modules cast where the code shows they do not train, and one where it does."""
import bitsandbytes as bnb
import torch
from torch.amp import GradScaler, autocast

scaler = GradScaler("cuda")


def train(args, model, backbone, loader, weight_dtype):
    train_backbone = args.backbone_lr != 0
    backbone.requires_grad_(train_backbone)
    if not train_backbone:
        backbone.to("cuda", dtype=weight_dtype)     # no finding: on this branch its gradients are off
    else:
        backbone.half()                             # finding: here the backbone trains
    opt = torch.optim.AdamW([*model.parameters(), *backbone.parameters()])
    for x in loader:
        with autocast("cuda"):
            loss = model(backbone(x)).float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def train_adapter(base, adapter, loader):
    base.to("cuda").to(torch.float16)               # low: the optimizer holds only the adapter's parameters
    base.train()
    opt = bnb.optim.Adam8bit(adapter.trainable_params(), 1e-3)   # an optimizer by its use (scaler.step)
    for x in loader:
        with autocast("cuda"):
            loss = base(adapter(x)).float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
