"""wrong-low-precision-cast: a cache forced to float16 for any reduced dtype, bfloat16 included (bug litgpt-rope-half-for-bf16)."""
import torch


def rope_cache(seq_len: int, dim: int, dtype: torch.dtype, device=None):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    if dtype in (torch.float16, torch.bfloat16):
        return angles.cos().half(), angles.sin().half()  # expect: AMP001
    return angles.cos(), angles.sin()


def forward_step(model, tokens):
    ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    with ctx:
        cos, sin = rope_cache(tokens.shape[1], model.head_dim, torch.bfloat16, tokens.device)
        return model(tokens, cos, sin)
