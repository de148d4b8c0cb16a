"""bce-under-autocast: a head computes BCE on probabilities in its forward, and the trainer runs that
forward under an autocast built with functools.partial (bug yolox-bce-on-probabilities)."""
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F


class Head(nn.Module):
    def forward(self, cls_logits, obj_logits, targets):
        probs = cls_logits.sigmoid() * obj_logits.sigmoid()
        return F.binary_cross_entropy(probs.sqrt(), targets, reduction="none").sum(-1)  # expect: AMP002


def train_step(head, batch, optimizer, scaler):
    amp_autocast = partial(torch.autocast, "cuda", dtype=torch.float16)
    with amp_autocast():
        loss = head(*batch).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
