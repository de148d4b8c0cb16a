"""clip-without-unscale: the scaler lives on self (bugs unet-clip-before-unscale, supergradients-clip-before-unscale)."""
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
