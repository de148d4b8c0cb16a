"""Clean twin of fp16_autocast_no_scaler: the GradScaler is enabled."""
import torch
import torch.nn.functional as F
from _tiny import Tiny, batch, seeded

USE_SCALER = True


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=USE_SCALER)
    for _ in range(steps):
        tokens, targets = batch(gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


if __name__ == "__main__":
    main()
