"""Bug kind attention-logits-overflow-fp16: under float16 autocast the attention scores q @ k^T
are computed before the 1/sqrt(d) scale, so large activations bring them to float16's max."""
import torch
from _tiny import BATCH, VOCAB, seeded

D = 64
SCALE_FIRST = False


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.q = torch.nn.Linear(D, D, bias=False)
        self.k = torch.nn.Linear(D, D, bias=False)
        self.out = torch.nn.Linear(D, VOCAB)
        with torch.no_grad():
            self.emb.weight.normal_(0, 6.0)
            self.q.weight.normal_(0, 1.0)
            self.k.weight.normal_(0, 1.0)

    def forward(self, tokens):
        h = self.emb(tokens)
        q, k = self.q(h), self.k(h)
        if SCALE_FIRST:
            scores = (q * D ** -0.5) @ k.transpose(1, 2)
        else:
            scores = (q @ k.transpose(1, 2)) * D ** -0.5
        attn = torch.softmax(scores.float(), dim=-1)
        return self.out((attn.to(h.dtype) @ h))


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, 16), generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


if __name__ == "__main__":
    main()
