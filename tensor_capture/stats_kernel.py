"""The capture statistics in one Triton pass over the tensor (the saver's path on CUDA).

Each program reads one tile once and writes its partials: finite count, sum and centred sum of
squares (float64, combined across tiles with Chan's parallel formula, so the variance does not
suffer the cancellation of sum-of-squares), min / max over finite values, smallest nonzero |x|,
zero / NaN / Inf counts, the four range counts per format, and its log2 histogram, added into
one global histogram. Combining the partials is a handful of small torch reductions on the
device: nothing here synchronizes with the host, like ``stats._compute_device``, whose
definitions (counts exact; min / max / mean / std over finite values) it reproduces; ``stats``
assembles the packed vector from these parts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.triton_kernels import load_f32

ELEMENTS_PER_PROGRAM = 4096
_F32_MIN_EXP = -149                  # float32 exponents of nonzero values: -149 .. 127
_F32_BINS = 127 - _F32_MIN_EXP + 1
_LOCAL_BINS = 512                    # power of two for tl.histogram; the last bin = "not counted"
_SKIP_BIN = _LOCAL_BINS - 1
_PARTIALS = 9                        # nf, sum, m2, min, max, min_nz, zeros, nans, infs


@triton.jit
def _stats_kernel(x_ptr, n, bounds_ptr, part_ptr, counts_ptr, hist_ptr,
                  NR: tl.constexpr, BLOCK: tl.constexpr, LOCAL_BINS: tl.constexpr,
                  SKIP_BIN: tl.constexpr, MIN_EXP: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    x = load_f32(x_ptr, offs, inb)
    a = tl.abs(x)
    isnan = inb & (x != x)
    isinf = inb & (a == float("inf"))
    finite = inb & (a < float("inf"))
    nonzero = finite & (a > 0.0)
    nf = tl.sum(finite.to(tl.int32), axis=0)
    xd = tl.where(finite, x, 0.0).to(tl.float64)
    s = tl.sum(xd, axis=0)
    mean_b = s / tl.maximum(nf, 1).to(tl.float64)
    d = tl.where(finite, xd - mean_b, 0.0)
    m2 = tl.sum(d * d, axis=0)
    mn = tl.min(tl.where(finite, x, float("inf")), axis=0)
    mx = tl.max(tl.where(finite, x, -float("inf")), axis=0)
    min_nz = tl.min(tl.where(nonzero, a, float("inf")), axis=0)
    zeros = tl.sum((finite & (a == 0.0)).to(tl.int32), axis=0)
    base = part_ptr + pid.to(tl.int64) * 9
    tl.store(base + 0, nf.to(tl.float64))
    tl.store(base + 1, s)
    tl.store(base + 2, m2)
    tl.store(base + 3, mn.to(tl.float64))
    tl.store(base + 4, mx.to(tl.float64))
    tl.store(base + 5, min_nz.to(tl.float64))
    tl.store(base + 6, zeros.to(tl.float64))
    tl.store(base + 7, tl.sum(isnan.to(tl.int32), axis=0).to(tl.float64))
    tl.store(base + 8, tl.sum(isinf.to(tl.int32), axis=0).to(tl.float64))
    # floor(log2|x|) from the bits; float32 subnormals are scaled by 2^64 first (exact)
    field = a.to(tl.int32, bitcast=True) >> 23
    sub = (a * 18446744073709551616.0).to(tl.int32, bitcast=True) >> 23
    e = tl.where(field > 0, field - 127, sub - 127 - 64)
    idx = tl.where(nonzero, e - MIN_EXP, SKIP_BIN)
    tl.atomic_add(hist_ptr + tl.arange(0, LOCAL_BINS), tl.histogram(idx, LOCAL_BINS))
    # per format: x >= up, x <= -up (Inf included), 0 < |x| < underflow / flush bound (finite)
    cbase = counts_ptr + pid.to(tl.int64) * (4 * NR)
    for r in tl.static_range(NR):
        up = tl.load(bounds_ptr + 3 * r)
        te_u = tl.load(bounds_ptr + 3 * r + 1)
        te_f = tl.load(bounds_ptr + 3 * r + 2)
        tl.store(cbase + 4 * r + 0, tl.sum((inb & (x >= up)).to(tl.int32), axis=0))
        tl.store(cbase + 4 * r + 1, tl.sum((inb & (x <= -up)).to(tl.int32), axis=0))
        tl.store(cbase + 4 * r + 2, tl.sum((nonzero & (a < te_u)).to(tl.int32), axis=0))
        tl.store(cbase + 4 * r + 3, tl.sum((nonzero & (a < te_f)).to(tl.int32), axis=0))


def supports(x: torch.Tensor) -> bool:
    """The kernel takes float32 / bfloat16 / float16 (float64 stays on the torch path)."""
    return x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def compute_parts(a: torch.Tensor, bounds: list[tuple[float, float, float]]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One pass over flat, non-empty ``a``: (the 9 scalars of ``stats``' packed layout as a
    float64 vector, the 4 counts per bound triple (overflow bound, underflow bound, flush
    bound) as float64, the float32-exponent histogram as float64, its first exponent)."""
    dev = a.device
    n = a.numel()
    nr = len(bounds)
    nprog = triton.cdiv(n, ELEMENTS_PER_PROGRAM)
    bnd = torch.tensor(bounds or [(0.0, 0.0, 0.0)], dtype=torch.float32).to(dev)
    part = torch.empty(nprog, _PARTIALS, dtype=torch.float64, device=dev)
    counts = torch.empty(nprog, max(4 * nr, 1), dtype=torch.int32, device=dev)
    hist = torch.zeros(_LOCAL_BINS, dtype=torch.int32, device=dev)
    _stats_kernel[(nprog,)](a, n, bnd, part, counts, hist, NR=nr, BLOCK=ELEMENTS_PER_PROGRAM,
                            LOCAL_BINS=_LOCAL_BINS, SKIP_BIN=_SKIP_BIN, MIN_EXP=_F32_MIN_EXP)
    nf_b, s_b, m2_b = part[:, 0], part[:, 1], part[:, 2]
    nf = nf_b.sum()
    mean = s_b.sum() / nf
    mean_b = s_b / nf_b.clamp_min(1)
    m2 = (m2_b + nf_b * (mean_b - mean) ** 2).sum()
    std = torch.where(nf > 1, (m2 / (nf - 1).clamp_min(1)).sqrt(), torch.zeros_like(m2))
    scalars = torch.stack([
        torch.tensor(float(n), dtype=torch.float64, device=dev), part[:, 3].amin(),
        part[:, 4].amax(), mean, std, part[:, 5].amin(), part[:, 6].sum(), part[:, 7].sum(),
        part[:, 8].sum()])
    range_counts = counts[:, :4 * nr].sum(0, dtype=torch.int64).to(torch.float64)
    return scalars, range_counts, hist[:_F32_BINS].to(torch.float64), _F32_MIN_EXP
