"""Shared pieces of the audit reproductions: a seeded tiny classifier and its batches."""
from __future__ import annotations

import torch

VOCAB, DIM, BATCH = 32, 16, 8


def seeded() -> torch.Generator:
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


class Tiny(torch.nn.Module):
    """Embedding -> MLP -> logits over VOCAB classes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.hidden = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.emb(tokens))))


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, 4), generator=gen)
    return tokens, tokens.roll(1, dims=1)


class MasterStep:
    """float32 master copies of a low-precision model's parameters, stepped by AdamW (the
    correct way to train a bf16 model; the reproductions use it to isolate their one bug)."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3) -> None:
        self.params = list(model.parameters())
        self.master = [p.detach().float().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr)

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
