"""clip-without-unscale: the scaler lives on self, or reaches an update helper as a parameter two
calls deep (bugs unet-clip-before-unscale, supergradients-clip-before-unscale, returnn-noise-and-clip-before-unscale)."""
import torch
from torch.nn import functional as F


class Trainer:
    def __init__(self, model, optimizer, max_norm):
        self.model, self.optimizer, self.max_norm = model, optimizer, max_norm
        self.scaler = torch.amp.GradScaler("cuda")

    def train_step(self, x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(self.model(x), y)
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)  # expect: AMP010
        self.scaler.step(self.optimizer)
        self.scaler.update()


def update(optimizer, params, grad_scaler=None):
    for p in params:
        p.grad += 1e-3 * torch.randn_like(p.grad)  # expect: AMP010
    grad_scaler.step(optimizer)
    grad_scaler.update()
