"""Clean twin of t5_ffn_fp16_overflow: the output projection runs in float32 (autocast off,
input upcast), as T5's fix keeps it."""
import torch
import torch.nn.functional as F
from _tiny import BATCH, VOCAB, seeded

D, FF = 32, 512
WO_IN_FP32 = True


class FeedForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.wi = torch.nn.Linear(D, FF, bias=False)
        self.wo = torch.nn.Linear(FF, D, bias=False)
        self.head = torch.nn.Linear(D, VOCAB)
        with torch.no_grad():
            self.emb.weight.normal_(0, 8.0)
            self.wi.weight.normal_(0, 1.0)
            self.wo.weight.normal_(6.0, 0.5)      # trained T5 checkpoints grow such large weights

    def forward(self, tokens):
        h = torch.relu(self.wi(self.emb(tokens)))
        if WO_IN_FP32:
            with torch.autocast("cpu", enabled=False):
                out = self.wo(h.float())
        else:
            out = self.wo(h)
        out = out.float()
        return self.head(out / out.norm(dim=-1, keepdim=True))


def main(steps: int = 3) -> None:
    gen = seeded()
    model = FeedForward()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, 8), generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


if __name__ == "__main__":
    main()
