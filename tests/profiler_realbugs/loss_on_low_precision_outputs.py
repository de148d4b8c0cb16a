"""loss-on-low-precision-outputs: accelerate runs forward under fp16 autocast; the loss on its
half-precision output is computed outside it (bugs diffusers-dreambooth-loss-fp16, diffusers-text2image-loss-fp16)."""
from accelerate import Accelerator
from torch.nn import functional as F

accelerator = Accelerator(mixed_precision="fp16")


def train(denoiser, loader, optimizer):
    denoiser, optimizer, loader = accelerator.prepare(denoiser, optimizer, loader)
    for noisy, noise in loader:
        pred = denoiser(noisy)
        loss = F.mse_loss(pred, noise)  # expect: AMP003
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
