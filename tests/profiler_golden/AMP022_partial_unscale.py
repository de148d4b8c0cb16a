import torch


class Fp16Trainer:
    def __init__(self, model, lr=1e-4):
        self.model_params = list(model.parameters())
        self.master_params = [p.detach().float().requires_grad_() for p in self.model_params]
        self.opt = torch.optim.AdamW(self.master_params, lr=lr)
        self.lg_loss_scale = 20.0

    def step(self, loss):
        (loss * 2 ** self.lg_loss_scale).backward()
        for m, p in zip(self.master_params, self.model_params):
            m.grad = p.grad.float()
        self.master_params[0].grad.mul_(1.0 / (2 ** self.lg_loss_scale))   # finding: one parameter only
        self.opt.step()
