"""Error metrics between a reference tensor and its quantized version (float32 math).

One function per metric; every tool uses these so numbers agree across reports. Each returns a
Python float. Inputs must have the same number of elements; non-finite inputs give NaN/Inf as
the math says (they are not silently dropped).
"""
from __future__ import annotations

import math

import torch

__all__ = ["mse", "rmse", "mae", "max_abs_error", "relative_error", "cosine_similarity", "psnr",
           "sqnr", "all_metrics", "from_sums", "sqnr_of_sums",
           "relative_error_of_sums"]


def _pair(ref, test, name: str):
    if not isinstance(ref, torch.Tensor) or not isinstance(test, torch.Tensor):
        raise TypeError(f"{name}: both arguments must be torch tensors")
    if ref.numel() != test.numel():
        raise ValueError(f"{name}: element counts differ ({ref.numel()} vs {test.numel()})")
    if ref.numel() == 0:
        raise ValueError(f"{name}: empty tensors have no error metric")
    a = ref.detach().reshape(-1).to(torch.float32)
    b = test.detach().reshape(-1).to(device=a.device, dtype=torch.float32)
    return a, b


def mse(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Mean squared error."""
    a, b = _pair(ref, test, "mse")
    return float(torch.mean((a - b) ** 2))


def rmse(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Root mean squared error."""
    return math.sqrt(mse(ref, test))


def mae(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Mean absolute error."""
    a, b = _pair(ref, test, "mae")
    return float(torch.mean((a - b).abs()))


def max_abs_error(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Largest absolute error."""
    a, b = _pair(ref, test, "max_abs_error")
    return float((a - b).abs().max())


def relative_error(ref: torch.Tensor, test: torch.Tensor) -> float:
    """||ref - test||_1 / ||ref||_1 (a fraction; x100 for percent). 0 when both are all zero,
    inf when only ref is."""
    a, b = _pair(ref, test, "relative_error")
    return relative_error_of_sums(float((a - b).abs().sum()), float(a.abs().sum()))


def relative_error_of_sums(abs_error_sum: float, abs_ref_sum: float) -> float:
    """relative_error from its two float32 sums (callers that compute many at once)."""
    if abs_ref_sum == 0.0:
        return 0.0 if abs_error_sum == 0.0 else math.inf
    return abs_error_sum / abs_ref_sum


def cosine_similarity(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Cosine of the angle between the flattened tensors; 1 when both are zero, 0 when one is."""
    a, b = _pair(ref, test, "cosine_similarity")
    # divide by the max magnitude first so neither the norms nor the dot product overflow
    sa, sb = float(a.abs().max()), float(b.abs().max())
    if sa == 0.0 or sb == 0.0:
        return 1.0 if sa == sb else 0.0
    a, b = a / sa, b / sb
    # the same reduction for all three sums, so cos(a, a) is exactly 1; clamp float32 rounding
    cos = torch.dot(a, b) / torch.sqrt(torch.dot(a, a) * torch.dot(b, b))
    return float(cos.clamp(-1.0, 1.0))


def psnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB with peak = max |ref|; inf when the error is zero."""
    a, b = _pair(ref, test, "psnr")
    err = float(torch.mean((a - b) ** 2))
    peak = float(a.abs().max())
    if err == 0.0:
        return math.inf
    if peak == 0.0:
        return -math.inf
    return 10.0 * math.log10(peak * peak / err)


def sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(sum ref^2 / sum (ref - test)^2)."""
    a, b = _pair(ref, test, "sqnr")
    return sqnr_of_sums(float(torch.sum(a * a)), float(torch.sum((a - b) ** 2)))


def sqnr_of_sums(signal: float, noise: float) -> float:
    """sqnr from sum ref^2 and sum (ref - test)^2 (callers that compute many at once)."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def all_metrics(ref: torch.Tensor, test: torch.Tensor) -> dict:
    """Every metric above in one dict (keys are the function names)."""
    return {f.__name__: f(ref, test) for f in (mse, rmse, mae, max_abs_error, relative_error,
                                                cosine_similarity, psnr, sqnr)}


def from_sums(n: int, sum_x2: float, sum_absx: float, amax: float, *, sum_q2: torch.Tensor,
              sum_xq: torch.Tensor, sse: torch.Tensor, sae: torch.Tensor,
              max_err: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics above for many test tensors at once, from sufficient statistics.

    For a reference ``x`` (n elements, sum x^2, sum |x|, max |x|) and each candidate ``q`` (one
    entry per candidate, by keyword: sum q^2, sum x*q, sum (x-q)^2, sum |x-q|, max |x-q|), the same
    definitions as mse ... relative_error: how the scale sweep gets every level from one pass.
    Returns float64 tensors keyed by the metric function names.
    """
    n = max(n, 1)
    mse_ = sse / n
    nx = math.sqrt(sum_x2)
    nq = sum_q2.sqrt()
    cos = torch.where((nq > 0) & (nx > 0), sum_xq / (nq * nx).clamp_min(1e-300),
                      torch.where((nq == 0) & (nx == 0), 1.0, 0.0))
    peak2 = amax ** 2
    if peak2 > 0:
        psnr_ = torch.where(mse_ > 0, 10 * torch.log10(peak2 / mse_.clamp_min(1e-300)), math.inf)
    else:
        psnr_ = torch.where(mse_ > 0, -math.inf, math.inf)
    if sum_absx > 0:
        rel = sae / sum_absx
    else:
        rel = torch.where(sae > 0, math.inf, 0.0).to(torch.float64)
    return {"mse": mse_, "rmse": mse_.sqrt(), "cosine_similarity":
            cos.to(torch.float64).clamp(-1.0, 1.0),   # as cosine_similarity: never 1 + eps
            "psnr": psnr_, "mae": sae / n, "max_abs_error": max_err.clone(),
            "relative_error": rel}
