"""Case 5: an outlier channel saturates an unscaled FP8 cast in one layer.

A 4-layer MLP whose third Linear receives activations with one huge feature (as LLM
activations often have). Cast to fp8_e4m3 without a scale, that feature exceeds 448 and
saturates, so this layer's output error jumps while the layers before it only show fp8's
ordinary rounding error.
Detected by: the layer-wise precision diff (``layer_diff``) naming that layer as the first jump.

    python -m training_profiler.skills.numerical_issues.case_outlier_saturation
"""
from __future__ import annotations

import torch

from training_profiler.layer_diff import DiffReport, layer_diff

OUTLIER_LAYER = "4"


class Outlier(torch.nn.Module):
    """Multiplies one feature by a large factor (a stand-in for an LLM outlier channel)."""

    def __init__(self, channel: int = 0, factor: float = 1e4) -> None:
        super().__init__()
        self.channel, self.factor = channel, factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        scale[self.channel] = self.factor
        return x * scale


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                Outlier(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8))
    x = torch.randn(32, 64)
    y = torch.randint(0, 8, (32,))
    return model, (lambda m: torch.nn.functional.cross_entropy(m(x), y))


def run(mode: str = "fp8_e4m3") -> DiffReport:
    model, step = build()
    return layer_diff(model, step, mode, group_size=2)


if __name__ == "__main__":
    print(run().to_text())
