import torch
import torch.nn.functional as F


class Trainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def restore(self, checkpoint):
        if "amp_scaling_state" in checkpoint:
            self.scaler.load_state_dict(checkpoint["amp_scaling_state"])

    def dump_checkpoint(self, step):
        checkpoint = {"step": step}
        checkpoint["optimizer"] = self.optimizer.state_dict()
        checkpoint["model"] = self.model.state_dict()
        if self.scaler.is_enabled() and "amp_scaling_state" in checkpoint:
            checkpoint["amp_scaling_state"] = self.scaler.state_dict()   # finding: never runs
        return checkpoint

    def fit(self, loader, path):
        for step, (x, y) in enumerate(loader):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(self.model(x), y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad()
        torch.save(self.dump_checkpoint(step), path)
