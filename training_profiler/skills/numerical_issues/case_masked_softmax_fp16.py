"""Case 4: a -1e9 attention mask and a softmax without dtype under fp16.

-1e9 does not exist in fp16 (max 65504): PyTorch refuses it in masked_fill on a float16
tensor, and where a cast lets it through it becomes -inf, so a fully masked row gives
softmax(-inf, ..., -inf) = NaN. The fix is torch.finfo(dtype).min.
Detected by: the static checker (AMP011 fp16-unsafe-constant, AMP004 softmax-without-dtype,
AMP008 fp16-without-gradscaler on this file).

    python -m training_profiler.skills.numerical_issues.case_masked_softmax_fp16
"""
from __future__ import annotations

import torch


def attention_probs(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = scores.masked_fill(mask, -1e9)
    return torch.softmax(scores, dim=-1)


def run() -> dict:
    """What the two halves of the mistake do at run time."""
    scores = torch.randn(2, 4, 4)
    mask = torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[0, 1] = True  # a fully masked row (a padding query)
    try:  # on a float16 tensor PyTorch refuses the constant outright
        scores.half().masked_fill(mask, -1e9)
        fp16_error = None
    except RuntimeError as exc:
        fp16_error = str(exc)
    # Where -1e9 did get through a cast, it is -inf, and a fully masked row is NaN.
    inf_masked = scores.masked_fill(mask, float("-inf"))
    nan_row = bool(torch.isnan(torch.softmax(inf_masked, dim=-1, dtype=torch.float32)[0, 1]).all())
    safe = scores.masked_fill(mask, torch.finfo(torch.float16).min)
    safe_finite = bool(torch.isfinite(torch.softmax(safe.half(), dim=-1, dtype=torch.float32)).all())
    return {"fp16_masked_fill_error": fp16_error, "nan_in_fully_masked_row": nan_row,
            "finfo_min_mask_is_finite": safe_finite}


def train_demo(model: torch.nn.Module, batches) -> None:
    """The training loop the case comes from (not executed by run())."""
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x.half()), y.half())
        loss.backward()
        opt.step()


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key}: {value}")
