"""Bug kind eps-underflow-fp16 / optimizer-state-downcast: a model converted with .half() is
stepped by Adam directly, so exp_avg_sq lives in float16 and eps=1e-8 rounds to zero there."""
import torch
import torch.nn.functional as F
from _tiny import Tiny, batch, seeded


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    for _ in range(steps):
        tokens, targets = batch(gen)
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
