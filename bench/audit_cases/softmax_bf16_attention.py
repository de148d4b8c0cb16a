"""Bug kind softmax-in-low-precision / softmax-without-dtype: a bfloat16 model (trained on float32
master weights) whose attention softmax runs on the bfloat16 scores."""
import torch
import torch.nn.functional as F
from _tiny import BATCH, VOCAB, MasterStep, seeded

D = 16


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.qk = torch.nn.Linear(D, 2 * D, bias=False)
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens)
        q, k = self.qk(h).chunk(2, dim=-1)
        attn = torch.softmax(q @ k.transpose(1, 2) * D ** -0.5, dim=-1)
        return self.head(attn @ h)


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Attention().to(torch.bfloat16)
    master = MasterStep(model)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, 8), generator=gen)
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
        loss.backward()
        master.step()


if __name__ == "__main__":
    main()
