"""Our own case: a training loop moves its frozen autoencoder to the run-time weight dtype and
encodes the loader's float32 images with it, outside autocast."""
import torch


def train(vae, unet, loader, optimizer, fp16):
    weight_dtype = torch.float16 if fp16 else torch.float32
    vae.to("cuda", dtype=weight_dtype)  # amp-check: ignore[AMP008]
    for batch in loader:
        with torch.no_grad():
            latents = vae.encode(batch["images"].to("cuda"))
        loss = unet(latents.float()).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
