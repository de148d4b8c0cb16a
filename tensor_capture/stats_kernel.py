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

ELEMENTS_PER_PROGRAM = 8192           # < 2^16: the packed counts of a tile cannot overflow
NUM_WARPS = 8
WINDOW = 64                            # exponent window of a tile's histogram (see the kernel)
_F32_MIN_EXP = -149                  # float32 exponents of nonzero values: -149 .. 127
_F32_BINS = 127 - _F32_MIN_EXP + 1
_LOCAL_BINS = 512                    # power of two for tl.histogram; the last bin = "not counted"
_SKIP_BIN = _LOCAL_BINS - 1
_PARTIALS = 5                        # sum, m2, min, max, min_nz (float64)


@triton.jit
def _pack4(a, b, c, d):
    """Four per-element 0/1 flags as one int64 (16 bits each): one reduction counts all four
    (a tile holds fewer than 2^16 elements, so no field overflows)."""
    return (a.to(tl.int64) | (b.to(tl.int64) << 16) | (c.to(tl.int64) << 32)
            | (d.to(tl.int64) << 48))


@triton.jit
def _store4(ptr, packed):
    tl.store(ptr + 0, (packed & 0xFFFF).to(tl.int32))
    tl.store(ptr + 1, ((packed >> 16) & 0xFFFF).to(tl.int32))
    tl.store(ptr + 2, ((packed >> 32) & 0xFFFF).to(tl.int32))
    tl.store(ptr + 3, ((packed >> 48) & 0xFFFF).to(tl.int32))


@triton.jit
def _stats_kernel(x_ptr, n, bounds_ptr, part_ptr, counts_ptr, hist_ptr,
                  NR: tl.constexpr, BLOCK: tl.constexpr, LOCAL_BINS: tl.constexpr,
                  SKIP_BIN: tl.constexpr, MIN_EXP: tl.constexpr, WINDOW: tl.constexpr,
                  PARTIALS: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    x = load_f32(x_ptr, offs, inb)
    a = tl.abs(x)
    finite = inb & (a < float("inf"))
    nonzero = finite & (a > 0.0)
    flags = tl.sum(_pack4(finite, finite & (a == 0.0), inb & (x != x),
                          inb & (a == float("inf"))), axis=0)
    nf = (flags & 0xFFFF).to(tl.float64)
    xd = tl.where(finite, x, 0.0).to(tl.float64)
    s = tl.sum(xd, axis=0)
    d = tl.where(finite, xd - s / tl.maximum(nf, 1.0), 0.0)
    m2 = tl.sum(d * d, axis=0)
    mn = tl.min(tl.where(finite, x, float("inf")), axis=0)
    mx = tl.max(tl.where(finite, x, -float("inf")), axis=0)
    min_nz = tl.min(tl.where(nonzero, a, float("inf")), axis=0)
    base = part_ptr + pid.to(tl.int64) * PARTIALS
    tl.store(base + 0, s)
    tl.store(base + 1, m2)
    tl.store(base + 2, mn.to(tl.float64))
    tl.store(base + 3, mx.to(tl.float64))
    tl.store(base + 4, min_nz.to(tl.float64))
    cbase = counts_ptr + pid.to(tl.int64) * (4 * NR + 4)
    _store4(cbase, flags)
    # per format: x >= up, x <= -up (Inf included), 0 < |x| < underflow / flush bound (finite)
    for r in tl.static_range(NR):
        up = tl.load(bounds_ptr + 3 * r)
        te_u = tl.load(bounds_ptr + 3 * r + 1)
        te_f = tl.load(bounds_ptr + 3 * r + 2)
        packed = tl.sum(_pack4(inb & (x >= up), inb & (x <= -up), nonzero & (a < te_u),
                               nonzero & (a < te_f)), axis=0)
        _store4(cbase + 4 + 4 * r, packed)
    # floor(log2|x|) from the bits; float32 subnormals are scaled by 2^64 first (exact).
    # A histogram costs in proportion to its bins, and a tile's values rarely span more than a
    # few dozen binades: count them in a window of WINDOW - 1 bins from the tile's smallest
    # exponent, and only the values beyond it (if any) in the full range. Only the bins the
    # tile touches are added to the global histogram (few atomics per tile).
    field = a.to(tl.int32, bitcast=True) >> 23
    sub = (a * 18446744073709551616.0).to(tl.int32, bitcast=True) >> 23
    e = tl.where(field > 0, field - 127, sub - 127 - 64)
    e_lo = tl.min(tl.where(nonzero, e, 1 << 20), axis=0)
    rel = e - e_lo
    inside = nonzero & (rel < WINDOW - 1)
    h = tl.histogram(tl.where(inside, rel, WINDOW - 1), WINDOW)
    win = tl.arange(0, WINDOW)
    first = tl.minimum(tl.maximum(e_lo - MIN_EXP, 0), LOCAL_BINS)
    tl.atomic_add(hist_ptr + first + win, h, mask=(h > 0) & (win < WINDOW - 1))
    beyond = nonzero & (rel >= WINDOW - 1)
    if tl.sum(beyond.to(tl.int32), axis=0) > 0:
        h2 = tl.histogram(tl.where(beyond, e - MIN_EXP, SKIP_BIN), LOCAL_BINS)
        bins = tl.arange(0, LOCAL_BINS)
        tl.atomic_add(hist_ptr + bins, h2, mask=(h2 > 0) & (bins < SKIP_BIN))


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
    counts = torch.empty(nprog, 4 * nr + 4, dtype=torch.int32, device=dev)
    hist = torch.zeros(_LOCAL_BINS + WINDOW, dtype=torch.int32, device=dev)
    _stats_kernel[(nprog,)](a, n, bnd, part, counts, hist, NR=nr, BLOCK=ELEMENTS_PER_PROGRAM,
                            LOCAL_BINS=_LOCAL_BINS, SKIP_BIN=_SKIP_BIN, MIN_EXP=_F32_MIN_EXP,
                            WINDOW=WINDOW, PARTIALS=_PARTIALS, num_warps=NUM_WARPS)
    totals = counts.sum(0, dtype=torch.int64).to(torch.float64)
    nf_b, s_b, m2_b = counts[:, 0].to(torch.float64), part[:, 0], part[:, 1]
    nf = totals[0]
    mean = s_b.sum() / nf
    mean_b = s_b / nf_b.clamp_min(1)
    m2 = (m2_b + nf_b * (mean_b - mean) ** 2).sum()
    std = torch.where(nf > 1, (m2 / (nf - 1).clamp_min(1)).sqrt(), torch.zeros_like(m2))
    scalars = torch.cat([torch.stack([
        torch.tensor(float(n), dtype=torch.float64, device=dev), part[:, 2].amin(),
        part[:, 3].amax(), mean, std, part[:, 4].amin()]), totals[1:4]])
    range_counts = totals[4:]
    return scalars, range_counts, hist[:_F32_BINS].to(torch.float64), _F32_MIN_EXP
