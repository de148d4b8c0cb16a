"""Bug kind loss-in-low-precision (FSDP2-style mixed precision): float32 parameters are cast to
bfloat16 inside forward, no autocast is on, so cross_entropy runs on bfloat16 logits."""
import torch
import torch.nn.functional as F
from _tiny import DIM, VOCAB, batch, seeded


class CastingHead(torch.nn.Module):
    """A float32 module computing in bfloat16, as a mixed-precision wrapper does."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens).to(torch.bfloat16)
        return F.linear(h, self.proj.weight.to(torch.bfloat16), self.proj.bias.to(torch.bfloat16))


def main(steps: int = 3) -> None:
    gen = seeded()
    model = CastingHead()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        tokens, targets = batch(gen)
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
