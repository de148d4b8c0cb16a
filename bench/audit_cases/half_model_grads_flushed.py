"""Bug kind fp16 gradient underflow: a .half() model whose loss is small (a down-weighted
auxiliary loss), stepped directly, gets gradients that are mostly zero or subnormal in float16."""
import torch
import torch.nn.functional as F
from _tiny import Tiny, batch, seeded

AUX_WEIGHT = 1e-4


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        tokens, targets = batch(gen)
        loss = AUX_WEIGHT * F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
