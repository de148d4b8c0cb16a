"""Clipping on the non-AMP branch, or after an unscale done by a helper, is fine."""
import torch


def unscale_all(scaler, opt):
    scaler.unscale_(opt)


def step(model, loss, opt, scaler=None):
    if scaler is not None:
        scaler.scale(loss).backward()
        unscale_all(scaler, opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # no finding: unscaled by the helper
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # no finding: the non-AMP branch
        opt.step()


def bad_step(model, loss, opt, scaler):
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)       # finding
    scaler.step(opt)
    scaler.update()
