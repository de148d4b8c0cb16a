import torch


def step(model, x):
    with torch.autocast("cuda"):
        h = model(x)
        inside = h.sum()                     # no finding: inside autocast
    total = h.sum()                          # finding
    avg = torch.mean(h)                      # finding
    safe = h.sum(dtype=torch.float32)        # no finding
    h = h.float()
    fine = h.mean()                          # no finding: reassigned to float32
    lp = x.bfloat16()
    bad = lp.mean()                          # finding
    return total, avg, safe, fine, bad, inside


def train(model, x, opt, scaler):
    out = step(model, x)
    scaler.scale(out[0].float()).backward()
    scaler.step(opt)
    scaler.update()
