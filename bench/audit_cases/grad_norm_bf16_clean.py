"""Clean twin of grad_norm_bf16: each norm is taken in float32."""
import torch
import torch.nn.functional as F
from _tiny import MasterStep, Tiny, batch, seeded


def grad_norm(params):
    return torch.stack([p.grad.float().norm() for p in params if p.grad is not None]).norm()


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Tiny().to(torch.bfloat16)
    master = MasterStep(model)
    for _ in range(steps):
        tokens, targets = batch(gen)
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
        loss.backward()
        print(f"grad norm {float(grad_norm(model.parameters())):.4f}")
        master.step()


if __name__ == "__main__":
    main()
