"""Object detector head training: case 2 of the seed (loss type under AMP)."""
import torch
from torch import nn
from torch.nn import functional as F


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.cls = nn.Linear(256, 80)
        self.box = nn.Linear(256, 4)

    def forward(self, feats):
        return torch.sigmoid(self.cls(feats)), self.box(feats)


def step(head, feats, labels, boxes, opt, scaler):
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        probs, pred_boxes = head(feats)
        cls_loss = F.binary_cross_entropy(probs, labels)  # expect: AMP002
        box_loss = F.smooth_l1_loss(pred_boxes, boxes)
        loss = cls_loss + box_loss
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(head.parameters(), 10.0)
    scaler.step(opt)
    scaler.update()
    return loss.detach()


def main():
    head = Head().cuda()
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda")
    feats = torch.randn(8, 256, device="cuda").half()  # expect: AMP001
    labels = torch.rand(8, 80, device="cuda")
    boxes = torch.randn(8, 4, device="cuda")
    step(head, feats, labels, boxes, opt, scaler)
