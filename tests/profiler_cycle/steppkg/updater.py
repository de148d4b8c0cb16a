import torch


class StepHelper:
    def __init__(self, model, lr=1e-3, clip=1.0):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.lr = lr
        self.clip = clip

    def change_lr(self, lr):
        self.lr = lr
        for group in self.opt.param_groups:
            group["lr"] = lr

    def clip_grads(self):
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)

    def state(self, scaler=None):
        return {"optimizer": self.opt.state_dict(), "scaler": scaler.state_dict() if scaler is not None else None}
