import copy

import torch


class ModelEMA:
    """An exponential moving average kept in a deep copy of the model."""

    def __init__(self, model, decay=0.9999):
        self.ema = copy.deepcopy(model).eval().half()   # finding: the average lives in float16
        self.decay = decay
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        with torch.no_grad():
            weights = model.state_dict()
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v *= self.decay
                    v += (1.0 - self.decay) * weights[k].detach()
