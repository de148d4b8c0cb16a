"""Clean twin of bce_under_autocast: binary_cross_entropy_with_logits on the logits."""
import torch
import torch.nn.functional as F
from _tiny import DIM, VOCAB, batch, seeded

WITH_LOGITS = True


class Scorer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.fc = torch.nn.Linear(DIM, 1)

    def forward(self, tokens):
        return self.fc(self.emb(tokens)).squeeze(-1)


def main(steps: int = 3) -> None:
    gen = seeded()
    model = Scorer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        tokens, targets = batch(gen)
        labels = (targets % 2).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
            if WITH_LOGITS:
                loss = F.binary_cross_entropy_with_logits(logits, labels)
            else:
                loss = F.binary_cross_entropy(torch.sigmoid(logits), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
