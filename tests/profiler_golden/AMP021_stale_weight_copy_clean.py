"""The clean twin: the copy is taken after the cast, in the weights' own dtype."""
import torch


def train(text_encoder, loader, optimizer, frozen_rows, fp16):
    weight_dtype = torch.float16 if fp16 else torch.float32
    if fp16:
        text_encoder.to(weight_dtype)  # amp-check: ignore[AMP008]
    original = text_encoder.get_input_embeddings().weight.data.detach().clone()
    for batch in loader:
        loss = text_encoder(batch).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            text_encoder.get_input_embeddings().weight[frozen_rows] = original[frozen_rows]
