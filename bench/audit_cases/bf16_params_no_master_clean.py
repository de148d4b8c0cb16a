"""Clean twin of bf16_params_no_master: a float32 model under bfloat16 autocast, so the
optimizer steps float32 weights."""
import torch
import torch.nn.functional as F
from _tiny import Tiny, batch, seeded


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        tokens, targets = batch(gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
