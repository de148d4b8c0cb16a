"""AMP003 judges what a call does, not what it is called."""
import torch.nn.functional as F
from torch import nn
from torch.amp import autocast


def compute_objective(pred, target):
    return F.cross_entropy(pred, target)


class Trainer:
    def __init__(self, loss_scaler):
        self.loss_scaler = loss_scaler
        self.criterion = nn.CrossEntropyLoss()

    def step(self, model, x, y, optimizer):
        with autocast("cuda"):
            out = model(x)
            loss = self.criterion(out, y)
        self.loss_scaler(loss, optimizer)          # no finding: applies the loss, computes none
        extra = compute_objective(out, y)          # finding: a project function returning a loss
        judged = self.criterion(out, y)            # finding: nn.CrossEntropyLoss held in an attribute
        return extra + judged
