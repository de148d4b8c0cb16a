import torch
import torch.nn.functional as F


def save(path, model, optimizer, scaler, step):
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    state["scaler"] = scaler.state_dict()            # no finding: the loss scale is saved
    torch.save(state, path)


def train(model, loader, optimizer, path):
    scaler = torch.amp.GradScaler("cuda")
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    save(path, model, optimizer, scaler, step)
