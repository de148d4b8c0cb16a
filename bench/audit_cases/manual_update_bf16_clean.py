"""Clean twin of manual_update_bf16: the same hand-written update applied to float32 master
copies, which are then copied into the bfloat16 model (a copy is not an update)."""
import torch
import torch.nn.functional as F
from _tiny import Tiny, batch, seeded

LR = 1e-3


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny().to(torch.bfloat16)
    master = [p.detach().float() for p in model.parameters()]
    for _ in range(steps):
        tokens, targets = batch(gen)
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p, m in zip(model.parameters(), master):
                m.add_(p.grad.float(), alpha=-LR)
                p.copy_(m)


if __name__ == "__main__":
    main()
