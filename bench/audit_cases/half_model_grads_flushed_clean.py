"""Clean twin of half_model_grads_flushed: a float32 model under float16 autocast with a
GradScaler, so the small loss is scaled before its gradients reach float16."""
import torch
import torch.nn.functional as F
from _tiny import Tiny, batch, seeded

AUX_WEIGHT = 1e-4


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14)
    for _ in range(steps):
        tokens, targets = batch(gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens)
        loss = AUX_WEIGHT * F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


if __name__ == "__main__":
    main()
