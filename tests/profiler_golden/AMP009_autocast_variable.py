"""The non-AMP branch is not the AMP path; an unscaled float16 path still is found."""
from contextlib import nullcontext
from functools import partial

import torch


def train(model, loader, opt, use_amp: bool, device: str):
    ctx = torch.autocast("cuda", dtype=torch.float16) if use_amp else nullcontext()
    amp = partial(torch.autocast, "cuda", dtype=torch.float16)
    for x, y in loader:
        with ctx:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()                          # AMP009: `ctx` holds an autocast
        with amp():
            loss2 = model(x).float().mean()
        loss2.backward()
        opt.step()
