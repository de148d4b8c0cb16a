"""Clean twin of mean_autocast_disabled: the pooled mean upcasts its bfloat16 input."""
import torch
import torch.nn.functional as F
from _tiny import DIM, VOCAB, batch, seeded


class Pooled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.proj(self.emb(tokens))
        with torch.autocast("cpu", enabled=False):
            pooled = h.float().mean(dim=1)
        return self.head(pooled)


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Pooled()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        tokens, targets = batch(gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(tokens), targets[:, 0])
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
