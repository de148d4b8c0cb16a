"""Legacy pure-fp16 training (no autocast): model and data cast by hand."""
import torch
import torch.nn as nn


class Scorer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Linear(d, d)

    def forward(self, x):
        s = self.w(x) @ x.transpose(0, 1)
        return torch.softmax(s, dim=-1)  # expect: AMP004


def main(data):
    model = Scorer(64).cuda().half()  # expect: AMP008
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-8)  # expect: AMP012
    for x in data:
        x = x.cuda().half()
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
