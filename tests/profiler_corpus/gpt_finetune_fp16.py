"""Fine-tune a small GPT with fp16 autocast (typical copy-pasted recipe with mistakes)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast  # expect: AMP007


class CausalSelfAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.h = h

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.h)
        att = att.masked_fill(mask[:t, :t] == 0, -1e9)  # expect: AMP011
        att = F.softmax(att, dim=-1)
        return self.proj(att @ v)


def train(model, loader, epochs=1):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scaler = GradScaler()
    for _ in range(epochs):
        for tokens, targets in loader:
            tokens, targets = tokens.cuda(), targets.cuda()
            opt.zero_grad(set_to_none=True)
            with autocast():
                logits = model(tokens)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))  # expect: AMP003
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: AMP010
            scaler.step(opt)
            scaler.update()
