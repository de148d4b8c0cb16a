"""ViT training with helpers: a few mistakes hide behind function boundaries."""
import torch
import torch.nn.functional as F
from torch.amp import GradScaler


def compute_objective(outputs, labels):
    return F.cross_entropy(outputs, labels, label_smoothing=0.1)


def forward_only(model, images):
    with torch.autocast("cuda", dtype=torch.float16):
        return model(images)


def train_epoch(model, loader, opt):
    scaler = GradScaler("cuda")
    for images, labels in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feats = model.backbone(images)
            outputs = model.head(feats)
        objective = compute_objective(outputs, labels)  # expect: AMP003
        scaler.scale(objective).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        outputs = forward_only(model, images)
        batch_score = outputs.sum()  # expect: AMP005
        print(batch_score)
