"""Image classifier trained with CPU bf16 autocast."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.fc = nn.Linear(16 * 30 * 30, 10)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).flatten(1))


def run(loader, epochs=2):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for _ in range(epochs):
        for images, targets in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = net(images)
                log_probs = F.log_softmax(logits, dim=1)  # expect: AMP004
                loss = F.nll_loss(log_probs, targets)
                loss.backward()  # expect: AMP009
            opt.step()
            opt.zero_grad()
            confidence = logits.mean()  # expect: AMP005
            print(f"loss {loss.item():.3f} conf {confidence.item():.3f}")
