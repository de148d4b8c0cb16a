import torch


def train(model, loader, opt):
    for x, y in loader:
        with torch.autocast("cuda"):          # finding: CUDA autocast defaults to float16
            loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
