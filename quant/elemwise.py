"""Element casts on float32 tensors, computed in integer bit space (exact, vectorized).

How: a magnitude ``a`` with float32 exponent e (from its bits, clamped to the format's grid range)
lies on the grid 2^(e - m) where m is the mantissa width at e. ``q = a * 2^(m - e)`` is exact (a
power-of-two scaling), the rounding mode turns q into an integer r, and ``r * 2^(e - m)`` is the
format value. Nearest-even rounding of the formats with a fixed mantissa width takes the same
value in fewer passes from the float adder: ``(a + c) - c`` with ``c = 2^(e + 23 - m)``
(:func:`_round_nearest_even_`; the Triton kernels round the same way). Powers of two are built
from their exponent bits, so nothing depends on libm.
NaN propagates through every step; +-Inf lands on the overflow path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .formats import FormatSpec


@dataclass(frozen=True)
class ElemParams:
    """The scalar constants one element cast needs (hashable: used as a compile cache key)."""

    grid_emin: int
    grid_emax: int          # exponent clamp on top: values beyond it overflow anyway
    mbits: int
    tapered: bool
    max_normal: float
    overflow: str           # "inf" | "nan" | "max" when saturate=False
    signed_zero: bool

    @staticmethod
    def of(spec: FormatSpec) -> "ElemParams":
        return ElemParams(grid_emin=spec.grid_emin, grid_emax=min(spec.emax + 1, 127),
                          mbits=spec.mbits, tapered=spec.tapered, max_normal=spec.max_normal,
                          overflow=spec.overflow_value, signed_zero=spec.signed_zero)


def pow2_from_exponent(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32 for integer k in [-126, 127] (normal range), built from the bits."""
    return ((k + 127) << 23).view(torch.float32)


def pow2_any(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32 for integer k in [-149, 127], including float32 subnormal powers."""
    k = k.to(torch.int32)
    normal = (k.clamp(min=-126) + 127) << 23
    sub = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, sub).view(torch.float32)


def float_exponent(a: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent floor(log2(a)) of non-negative float32 a from its bits (-127 for zero and
    subnormals, 128 for Inf/NaN)."""
    return (a.view(torch.int32) >> 23).sub_(127)


def _mantissa_bits(e: torch.Tensor, p: ElemParams):
    if not p.tapered:
        return p.mbits
    # HiF8: 3 bits for |E|<=3, 2 for 4..7, 1 for 8..15, 0 for the denormal grid / beyond range
    ae = e.abs()
    return 3 - (ae >= 4).to(torch.int32) - (ae >= 8).to(torch.int32) - (ae >= 16).to(torch.int32)


def round_magnitude_(a: torch.Tensor, p: ElemParams, rounding: str,
                     noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Round non-negative float32 magnitudes onto the format grid, without saturation, IN PLACE
    (``a`` is overwritten and returned; few temporaries keep the eager path fast).

    ``noise`` (uniform [0, 1), same shape) is required for rounding="stochastic".
    """
    if rounding == "nearest_even" and _adder_rounds(p):
        return _round_nearest_even_(a, p)
    e = float_exponent(a).clamp_(p.grid_emin, p.grid_emax)
    m = _mantissa_bits(e, p)
    # q = a * 2^(m - e) with one power of two when both 2^(m-e) and 2^(e-m) are normal floats
    # (every format but bf16); otherwise split as 2^(1-e) * 2^(m-1)
    single = p.tapered or (p.mbits - p.grid_emin <= 126 and p.grid_emax - p.mbits <= 126)
    if single:
        k = (m - e).add_(127) if p.tapered else e.neg().add_(127 + m)    # one temporary
        a.mul_(k.bitwise_left_shift_(23).view(torch.float32))
        down = None
    else:
        a.mul_(((128 - e) << 23).view(torch.float32))
        a.mul_(2.0 ** (m - 1))
        down = 2.0 ** (-m)
    if rounding == "nearest_even":
        a.round_()
    elif rounding in ("nearest_away", "stochastic", "hybrid"):
        r = torch.floor(a)       # a - floor(a) is exact; a + 0.5 would round for small a
        frac = a.sub_(r)
        if rounding == "nearest_away":
            r.add_(frac.ge_(0.5).to(r.dtype))
        else:
            if noise is None:
                raise ValueError(f"{rounding} rounding needs uniform noise")
            up = noise < frac
            if rounding == "hybrid":  # HiF8: ties away for |E| <= 3, stochastic for |E| >= 4
                up = torch.where(e.abs() >= 4, up, frac >= 0.5)
            r.add_(up.to(r.dtype))
        a = r
    elif rounding == "toward_zero":
        a.floor_()
    else:  # validated by the caller; kept as a guard for direct use
        raise ValueError(f"unknown rounding mode {rounding!r}")
    if single:
        return a.mul_(e.add_(127 - m).bitwise_left_shift_(23).view(torch.float32))
    a.mul_(down)
    return a.mul_(e.add_(127).bitwise_left_shift_(23).view(torch.float32))


def _adder_rounds(p: ElemParams) -> bool:
    """Whether nearest-even rounding can use the float adder (:func:`_round_nearest_even_`):
    a fixed mantissa width of at most 22 bits (so c below is above every magnitude of its
    binade) and 2^(e + 23 - m) a normal float32 over the whole grid."""
    return (not p.tapered and p.mbits <= 22 and p.grid_emax + 23 - p.mbits <= 127
            and p.grid_emin + 23 - p.mbits >= -126)


def _round_nearest_even_(a: torch.Tensor, p: ElemParams) -> torch.Tensor:
    """round_magnitude_'s nearest-even rounding by the float adder, in place (about half the
    passes over memory of multiply, round, multiply; the same values).

    For binade e (a's exponent clamped to the grid), c = 2^(e + 23 - m) >= 2^(e + 1): a + c
    lies in [c, 2c) whose float32 spacing is the grid step 2^(e - m), so the adder rounds a to
    the grid (ties to even: c is an even number of steps) and subtracting c back is exact. Only
    a magnitude of 2^(e_top + 23 - m) or more (far beyond max_normal) may come out otherwise than
    by multiply-round-multiply, and still beyond max_normal (Inf and NaN stay): saturation,
    overflow encoding and every overflow test see the same.
    """
    c = (a.view(torch.int32) & 0x7F800000).clamp_((p.grid_emin + 127) << 23,
                                                  (p.grid_emax + 127) << 23)
    c = c.add_((23 - p.mbits) << 23).view(torch.float32)
    return a.add_(c).sub_(c)


def round_magnitude(a: torch.Tensor, p: ElemParams, rounding: str,
                    noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Out-of-place round_magnitude_ (``a`` is left untouched)."""
    return round_magnitude_(a.clone(), p, rounding, noise)


def finish(r: torch.Tensor, x: torch.Tensor, p: ElemParams, saturate: bool) -> torch.Tensor:
    """Apply saturation / overflow encoding and the sign of x to rounded magnitudes r (in
    place on r, which must be a fresh tensor)."""
    if saturate or p.overflow == "max":
        r = r.clamp_(max=p.max_normal)               # NaN stays NaN, Inf -> max_normal
    else:
        over = float("inf") if p.overflow == "inf" else float("nan")
        r = r.masked_fill_(r > p.max_normal, over)
    r = r.copysign_(x)
    if not p.signed_zero:
        r = r.add_(0.0)  # -0 -> +0 (HiF8 has a single zero code)
    return r


def cast_elements(x: torch.Tensor, p: ElemParams, rounding: str, saturate: bool,
                  noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Fake-quantize float32 x element by element (no scaling)."""
    return finish(round_magnitude_(x.abs(), p, rounding, noise), x, p, saturate)
