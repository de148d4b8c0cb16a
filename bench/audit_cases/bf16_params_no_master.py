"""Bug kind trainable-params-in-fp16 / low-precision-cast-of-trained-params: the model is cast to
bfloat16 and the optimizer steps those parameters directly: small updates round away."""
import torch
import torch.nn.functional as F
from _tiny import Tiny, batch, seeded


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        tokens, targets = batch(gen)
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
