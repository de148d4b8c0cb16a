import torch


class Attention(torch.nn.Module):
    def forward(self, q, k):
        scores = q @ k.transpose(-1, -2)
        return scores.softmax(dim=-1)                   # finding: model trained in manual half


model = Attention().half()
probs = torch.softmax(torch.randn(2, 2), -1, dtype=torch.float32)   # no finding
