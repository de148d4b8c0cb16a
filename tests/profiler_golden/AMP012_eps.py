import torch

model = torch.nn.Linear(4, 4).half()
opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)    # finding
opt2 = torch.optim.AdamW(model.parameters(), eps=1e-4)          # no finding
model(torch.randn(2, 4).half()).float().sum().backward()
opt.step()
