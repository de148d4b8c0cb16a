"""The clean twin: the images are cast to the autoencoder's dtype before encoding."""
import torch


def train(vae, unet, loader, optimizer, fp16):
    weight_dtype = torch.float16 if fp16 else torch.float32
    vae.to("cuda", dtype=weight_dtype)  # amp-check: ignore[AMP008]
    for batch in loader:
        with torch.no_grad():
            latents = vae.encode(batch["images"].to("cuda", dtype=weight_dtype))
        loss = unet(latents.float()).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
