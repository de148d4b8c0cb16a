"""loss-scale-not-removed: a hand-written float16 trainer (master weights, its own loss scale)
divides the scale out of some gradients only (bug guided-diffusion-partial-unscale)."""
import torch


class MasterWeightsTrainer:
    def __init__(self, master_params, optimizer, log2_scale=20.0):
        self.master_params, self.opt, self.log2_scale = master_params, optimizer, log2_scale

    def step(self, loss):
        (loss * 2 ** self.log2_scale).backward()
        self.master_params[0].grad.mul_(2 ** -self.log2_scale)  # expect: AMP022
        self.opt.step()
        for p in self.master_params:
            p.grad = None
