"""Tolerances from error bounds, so that a numeric comparison holds on every processor.

Why: a float32 reduction's last bits depend on the order of its additions, and that order
changes with the processor (ATen's ``ATEN_CPU_CAPABILITY`` kernels, the BLAS code path MKL picks
for the CPU, ``MKL_CBWR``), the thread count and the library version. A tolerance picked because
it passed here (``rel=1e-6`` on a sum of half a million squares) fails on the next machine. What
does not depend on the order is the bound of floating-point summation: any order of n - 1
additions of n terms, each rounded with unit roundoff u, errs by at most
``gamma(n - 1) * sum(|term|)`` with ``gamma(k) = k u / (1 - k u)`` (the standard first-order-free
bound of recursive summation; pairwise and blocked orders are special cases of it). A dot product
adds one rounding per product: ``gamma(n) * sum(|a_i b_i|)``.

Use these where the arithmetic of the thing compared is inexact; where the comparison can be made
exact instead (data whose every partial sum is representable, float64 accumulation), prefer that.
"""
from __future__ import annotations

import math

import torch

#: unit roundoff (half an ulp of 1) of each floating dtype a reduction may accumulate in
UNIT_ROUNDOFF = {
    torch.float64: 2.0 ** -53,
    torch.float32: 2.0 ** -24,
    torch.float16: 2.0 ** -11,
    torch.bfloat16: 2.0 ** -8,
}


def gamma(k: int, dtype: torch.dtype = torch.float32) -> float:
    """gamma_k = k u / (1 - k u): the relative error bound of k rounded operations in a row."""
    ku = max(k, 0) * UNIT_ROUNDOFF[dtype]
    if ku >= 1:
        raise ValueError(f"gamma({k}) is unbounded in {dtype}: too many operations")
    return ku / (1 - ku)


def sum_error_bound(terms: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """How far a sum of ``terms`` accumulated in ``dtype`` may be from the exact sum, in any
    order of additions."""
    t = terms.detach().reshape(-1).double()
    return gamma(t.numel() - 1, dtype) * float(t.abs().sum())


def dot_error_bound(a: torch.Tensor, b: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> float:
    """How far a dot product of ``a`` and ``b`` in ``dtype`` may be from the exact one, in any
    order (one rounding per product and per addition)."""
    a64, b64 = a.detach().reshape(-1).double(), b.detach().reshape(-1).double()
    return gamma(a64.numel(), dtype) * float((a64 * b64).abs().sum())


def exact_sum(terms: torch.Tensor) -> float:
    """The sum of ``terms`` in float64: exact to float64's own bound, which is 2^29 times
    tighter than float32's, so it stands for the exact value against a float32 result."""
    return float(terms.detach().reshape(-1).double().sum())


def exact_sumsq(terms: torch.Tensor) -> float:
    """The sum of squares of ``terms`` in float64 (see :func:`exact_sum`)."""
    t = terms.detach().reshape(-1).double()
    return float(torch.dot(t, t))


def mean_error_bound(values: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """How far a mean whose sum was accumulated in ``dtype`` (then divided in float64) may be
    from the exact mean of ``values``."""
    v = values.detach().reshape(-1).double()
    n = max(v.numel(), 1)
    return sum_error_bound(v, dtype) / n + gamma(1, torch.float64) * abs(float(v.mean()))


def std_error_bound(values: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """How far the two-pass sample standard deviation (ddof 1) may be from the exact one when
    both passes accumulate in ``dtype``: the mean m (error D, plus one rounding to ``dtype``),
    then sum((x - m)^2), perhaps of (x - m) / s with s = max |x| (which keeps the squares in
    range). With exact S = sum((x - mean)^2): sum((x - m)^2) = S + n D^2, each term rounded by
    the subtraction, the scaling, the square and n - 1 additions (gamma(n + 4)), and squares
    below the dtype's smallest subnormal lost (n * tiny * max(1, s^2)). The square root halves
    the relative error: |sqrt(a) - sqrt(b)| <= min(sqrt|a - b|, |a - b| / sqrt(b))."""
    v = values.detach().reshape(-1).double()
    n = v.numel()
    if n < 2:
        return 0.0
    mean = float(v.mean())
    exact = float(((v - mean) ** 2).sum())
    drift = mean_error_bound(v, dtype) + UNIT_ROUNDOFF[dtype] * abs(mean)
    absmax = float(v.abs().max())
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps   # the smallest subnormal
    lost = n * tiny * max(1.0, absmax * absmax)
    d_sq = gamma(n + 4, dtype) * (exact + n * drift ** 2) + n * drift ** 2 + lost
    d_var = d_sq / (n - 1)
    std = (exact / (n - 1)) ** 0.5
    own = min(d_var ** 0.5, d_var / std if std > 0 else float("inf"))
    return own + gamma(n + 4, torch.float64) * std      # the float64 reference's own error


def merged_moments_error_bounds(parts: list[torch.Tensor],
                                dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """Bounds on the mean and the standard deviation of the concatenated ``parts`` when they
    are merged (in float64) from each part's count, mean and std, each of those computed by the
    two-pass algorithm in ``dtype`` (:func:`mean_error_bound`, :func:`std_error_bound`).

    With the parts' exact means m_i and stds s_i, the merged mean M and the errors dm_i, ds_i:
    the mean is off by at most dM = sum(n_i dm_i) / N; the centred sum of squares
    sum((n_i - 1) s_i^2 + n_i (m_i - M)^2) by sum((n_i - 1)(2 s_i ds_i + ds_i^2)) +
    sum(n_i (2 |m_i - M| dm_i + dm_i^2)) + N dM^2 (the last from re-centring on the computed
    mean); the square root as in :func:`std_error_bound`."""
    vs = [p.detach().reshape(-1).double() for p in parts]
    whole = torch.cat(vs)
    n_all = whole.numel()
    big_m = float(whole.mean())
    dm = [mean_error_bound(v, dtype) for v in vs]
    d_mean = sum(v.numel() * d for v, d in zip(vs, dm)) / n_all
    d_sq = n_all * d_mean ** 2
    for v, d in zip(vs, dm):
        n, m = v.numel(), float(v.mean())
        s = float(v.std()) if n > 1 else 0.0
        ds = std_error_bound(v, dtype)
        d_sq += (n - 1) * (2 * s * ds + ds * ds) + n * (2 * abs(m - big_m) * d + d * d)
    d_var = d_sq / (n_all - 1)
    std = float(whole.std())
    d_std = min(d_var ** 0.5, d_var / std if std > 0 else float("inf"))
    f64 = gamma(4 * len(vs) + 4, torch.float64)            # the float64 merge's own roundings
    return d_mean + f64 * abs(big_m), d_std + f64 * std


def sqnr_db_bound(n: int, dtype: torch.dtype = torch.float32) -> float:
    """How far an SQNR in dB, 10 log10(sum x^2 / sum (x - q)^2) over n elements with both sums
    accumulated in ``dtype``, may be from a float64 computation of it. Both sums have nonnegative
    terms, so their relative errors are at most gamma(n) (a square, n - 1 additions) and
    gamma(n + 2) (a subtraction more); the dB error is then at most
    10 log10((1 + gamma(n)) / (1 - gamma(n + 2))), plus the same for the float64 reference."""
    def db(acc: torch.dtype) -> float:
        return 10 * math.log10((1 + gamma(n, acc)) / (1 - gamma(n + 2, acc)))
    return db(dtype) + db(torch.float64)


def ratio_of_sums_bound(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The relative error bound of a ratio of two sums of n nonnegative terms accumulated in
    ``dtype``, e.g. a relative error sum|x - q| / sum|x| (numerator gamma(n + 1) with its
    subtraction, denominator gamma(n - 1), one division): for comparison with ``rel=``."""
    num, den = gamma(n + 1, dtype), gamma(n - 1, dtype)
    return (1 + num) / (1 - den) * (1 + gamma(1, dtype)) - 1 + gamma(n + 2, torch.float64)
