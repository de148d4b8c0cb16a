import torch


def accumulate(model, loader, opt, scaler, accum):
    for i, (x, y) in enumerate(loader):
        loss = model(x, y) / accum
        scaler.scale(loss).backward()
        scaler.unscale_(opt)                                       # finding: every micro-step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if (i + 1) % accum == 0:
            scaler.step(opt)
            scaler.update()


def accumulate_right(model, loader, opt, scaler, accum, clip=None):
    for i, (x, y) in enumerate(loader):
        scaler.scale(model(x, y) / accum).backward()
        if (i + 1) % accum == 0:
            if clip is not None:
                scaler.unscale_(opt)                               # no finding: only when stepping
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()


def every_step(model, x, y, opt, scaler, clip=None):
    scaler.scale(model(x, y)).backward()
    if clip is not None:
        scaler.unscale_(opt)                                       # no finding: step is unconditional
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()
