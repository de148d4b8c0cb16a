"""Our own case: a trainer that casts its model to float16 and keeps a moving average of the
parameters as plain detached copies, so the average is float16 too."""
import torch


def build(model, use_fp16):
    if use_fp16:
        model.half()  # amp-check: ignore[AMP008]
    return model


class Trainer:
    def __init__(self, model, optimizer, decay=0.9999):
        self.model, self.optimizer, self.decay = model, optimizer, decay
        self.moving_average = None

    def update_average(self):
        if self.moving_average is None:
            copies = [p.detach() for p in self.model.parameters()]
            self.moving_average = copies
            return
        for avg, p in zip(self.moving_average, self.model.parameters()):
            avg.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def step(self, batch):
        loss = self.model(batch).float().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.update_average()
