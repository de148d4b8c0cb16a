"""Case 1: dimension imbalance — big numbers eat small ones in a bf16 reduction.

A detector's box head predicts [N, 2] values whose first column lives around 1e3 and second
around 1e0. Summing the tensor (a loss reduction) in bf16 loses the second column completely.
Detected by: ``analyze_tensor`` (risk HIGH, dimension 1 named, FP32 reduction suggested).

    python -m training_profiler.skills.numerical_issues.case_dim_imbalance
"""
from __future__ import annotations

import torch

from training_profiler import analyze_tensor


def make_tensor(n: int = 1000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    big = 1000.0 + 100.0 * torch.randn(n, generator=g)
    small = 0.5 + 0.1 * torch.randn(n, generator=g)
    return torch.stack([big, small], dim=1)


def run() -> dict:
    x = make_tensor()
    report = analyze_tensor(x, "bbox_pred", formats=["bf16", "fp8_e4m3"])
    # What the imbalance does: adding the small column to the big one in bf16 changes nothing.
    rows_bf16 = x.bfloat16()
    lost = (rows_bf16[:, 0] + rows_bf16[:, 1] == rows_bf16[:, 0]).float().mean().item()
    report["fraction_of_rows_where_bf16_sum_drops_dim1"] = lost
    return report


if __name__ == "__main__":
    from training_profiler.tensor_analyzer import format_report

    r = run()
    print(format_report(r))
    print(f"bf16 row sums that ignore dimension 1 entirely: {r['fraction_of_rows_where_bf16_sum_drops_dim1']:.1%}")
