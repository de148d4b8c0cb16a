import torch
import torch.nn.functional as F
from accelerate import Accelerator


def main(args, unet, optimizer, loader):
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    for batch in loader:
        model_pred = unet(batch["x"]).sample
        pred, pred_prior = torch.chunk(model_pred, 2, dim=0)
        loss = F.mse_loss(pred, batch["y"])                          # finding: raw mixed-precision output
        prior = F.mse_loss(pred_prior.float(), batch["y"].float())   # no finding: cast to float32
        accelerator.backward(loss + prior)
        optimizer.step()


def no_mixed(unet, loader):
    accelerator = Accelerator(mixed_precision="no")
    unet = accelerator.prepare(unet)
    for batch in loader:
        out = unet(batch["x"])
        F.mse_loss(out, batch["y"]).backward()                       # no finding: full precision
