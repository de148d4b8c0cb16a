import torch


class Attention(torch.nn.Module):
    def forward(self, q, k):
        scores = q @ k.transpose(-1, -2)
        return scores.softmax(dim=-1)                   # finding: model trained in manual half


model = Attention().half()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 2), torch.randn(2, 2)).sum().backward()   # trained in float16
opt.step()
probs = torch.softmax(torch.randn(2, 2), -1, dtype=torch.float32)   # no finding
