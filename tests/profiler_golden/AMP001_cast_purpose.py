"""Casts with a purpose other than training are not manual casts in training."""
import copy

import torch
from torch.amp import GradScaler, autocast

scaler = GradScaler("cuda")


def train(model, encoder, vae, loader, opt):
    encoder.requires_grad_(False)
    encoder.half()                                  # no finding: a frozen encoder
    for p in vae.parameters():
        p.requires_grad = False
    vae = vae.to(dtype=torch.float16)               # no finding: frozen, bound back to the frozen name
    model.half()                                    # finding: the trained model
    for x, y in loader:
        with autocast("cuda"):
            loss = model(encoder(x)).float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def save(model, path):
    torch.save({k: v.half() for k, v in model.state_dict().items()}, path)   # no finding: checkpoint copy
    fp16_copy = copy.deepcopy(model).half()                                  # no finding: a copy
    torch.save(fp16_copy, path + ".pt")


@torch.no_grad()
def evaluate(model, x):
    return model.half()(x.half())                   # no finding: evaluation under no_grad


def final_eval(model, x):
    model.eval()
    model = model.half()                            # no finding: an evaluation-only function
    return model(x)


def quantize_like_fp16(w):
    return w.half().float()                         # no finding: a round trip, the result is float32
