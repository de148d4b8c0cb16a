import torch


def make_scaler(mixed_precision: str):
    if mixed_precision == "fp16":
        return torch.amp.GradScaler("cuda")                         # no finding
    elif mixed_precision == "bf16":
        return torch.amp.GradScaler("cuda")                         # finding: bf16 path
    return None


def make_scaler_right(dtype):
    if dtype != torch.bfloat16:
        return torch.amp.GradScaler("cuda")                         # no finding: not the bf16 path
    return torch.amp.GradScaler("cuda", enabled=False)
