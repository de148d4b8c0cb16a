import torch

from .updater import StepHelper


class Engine:
    def __init__(self, model, lr, use_amp=True):
        self.model = model
        self.lr = lr
        self.scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
        self.helper = StepHelper(self.model, lr=self.lr)

    def start_epoch(self, lr):
        self.lr = lr
        self.helper.change_lr(self.lr)

    def train_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch).float().mean()
        self.scaler.scale(loss).backward()
        self.helper.clip_grads()  # expect: AMP010
        self.scaler.step(self.helper.opt)
        self.scaler.update()
        self.helper.opt.zero_grad()
        return loss.detach()

    def checkpoint(self, path):
        torch.save({"model": self.model.state_dict(), **self.helper.state(scaler=self.scaler)}, path)
