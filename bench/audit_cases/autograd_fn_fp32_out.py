"""Bug kind kernel-output-dtype-mismatch / autograd-function-no-custom-fwd: a custom Function
computes in float32 and returns float32 for the bfloat16 activations autocast gives it; without
custom_fwd its backward runs outside autocast with mismatched dtypes."""
import torch
import torch.nn.functional as F
from _tiny import DIM, VOCAB, batch, seeded


class ScaledGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x.float()) * 1.5

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.float().detach().requires_grad_()
        with torch.enable_grad():
            y = F.gelu(x) * 1.5
        return torch.autograd.grad(y, x, grad.float())[0].to(ctx.saved_tensors[0].dtype)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.fc = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        return self.head(ScaledGelu.apply(self.fc(self.emb(tokens))))


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
