import torch
import torch.nn.functional as F


def load_average(model, averages):
    """Validation with averaged weights kept in float32: each is cast only to match a half model."""
    for avg, param in zip(averages, model.parameters()):
        param.data = avg.data.half() if param.dtype == torch.float16 else avg.data   # silent: matches


def train(model, loader, optimizer, averages):
    scaler = torch.amp.GradScaler("cuda")
    model.half()                                     # finding: chooses float16 for the trained model
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    load_average(model, averages)


def update_average(model, averages, decay=0.999):
    """A moving average copied in the tested dtype is state kept in half precision: still reported."""
    if averages is None:
        return [p.detach().half() if p.dtype == torch.float16 else p.detach().float()   # finding
                for p in model.parameters()]
    return [decay * a + (1 - decay) * p.detach() for a, p in zip(averages, model.parameters())]
