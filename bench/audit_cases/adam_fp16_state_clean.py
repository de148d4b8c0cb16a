"""Clean twin of adam_fp16_state: a float32 model under float16 autocast with a GradScaler, so
Adam's state and eps stay in float32."""
import torch
import torch.nn.functional as F
from _tiny import Tiny, batch, seeded


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
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
