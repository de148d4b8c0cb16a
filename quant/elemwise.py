"""Element casts on float32 tensors, computed in integer bit space (exact, vectorized).

How: a magnitude ``a`` with float32 exponent e (from its bits, clamped to the format's grid range)
lies on the grid 2^(e - m) where m is the mantissa width at e. ``q = a * 2^(m - e)`` is exact (a
power-of-two scaling), the rounding mode turns q into an integer r, and ``r * 2^(e - m)`` is the
format value. Nearest-even rounding of the formats with a fixed mantissa width takes the same
value in fewer passes from the float adder: ``(a + c) - c`` with ``c = 2^(e + 23 - m)``
(:func:`_round_nearest_even_`; the Triton kernels round the same way). Powers of two are built
from their exponent bits, so nothing depends on libm.
NaN propagates through every step; +-Inf lands on the overflow path.
Several formats at once (one per row of a stacked tensor: the one-pass what-if) go through
:func:`cast_rows_`, which takes the same steps with the grid constants as per-row columns
(:class:`RowParams`), so there is one element cast for every caller.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

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


def grid_exponent(a: torch.Tensor, lo, hi) -> torch.Tensor:
    """The binade of each magnitude on the format's grid: a's float32 exponent clamped to
    [lo, hi] (ints, or int32 columns that broadcast over ``a``: one format per row)."""
    return float_exponent(a).clamp_(lo, hi)


def tapered_mantissa_bits(e: torch.Tensor) -> torch.Tensor:
    """HiF8's mantissa width at grid exponent e: 3 bits for |E|<=3, 2 for 4..7, 1 for 8..15,
    0 for the denormal grid / beyond range.

    The width drops by one at |E| = 4, 8 and 16, the powers of two, so it is 4 - floor(log2 |E|)
    for |E| clamped to [2, 16]; floor(log2) of that small int is the exponent field of its exact
    float32 value (five vector ops where three compare-and-convert steps took fifteen)."""
    field = e.abs().clamp_(2, 16).to(torch.float32).view(torch.int32) >> 23
    return (4 + 127) - field


def _mantissa_bits(e: torch.Tensor, p: ElemParams):
    return tapered_mantissa_bits(e) if p.tapered else p.mbits


def powers_are_normal(p: ElemParams) -> bool:
    """Whether 2^(m - e) and 2^(e - m) are normal floats over the whole grid (every format but
    bf16 and fp32), so one power of two scales a magnitude to grid steps and back."""
    return p.tapered or (p.mbits - p.grid_emin <= 126 and p.grid_emax - p.mbits <= 126)


def to_grid_steps_(a: torch.Tensor, e: torch.Tensor, m) -> torch.Tensor:
    """a *= 2^(m - e) in place (exact): the magnitude counted in steps of its binade's grid.
    ``m`` is an int or an int32 tensor broadcasting over ``a``; needs powers_are_normal."""
    k = e.neg().add_(127 + m) if isinstance(m, int) else (127 + m) - e  # one full-size temporary
    return a.mul_(k.bitwise_left_shift_(23).view(torch.float32))


def from_grid_steps_(r: torch.Tensor, e: torch.Tensor, m) -> torch.Tensor:
    """r *= 2^(e - m) in place: whole grid steps back to magnitudes (``e`` is overwritten)."""
    return r.mul_(e.add_(127 - m).bitwise_left_shift_(23).view(torch.float32))


def round_ties_away_(a: torch.Tensor) -> torch.Tensor:
    """Non-negative ``a`` rounded to integers, ties away from zero (``a`` is overwritten with
    its fraction; a - floor(a) is exact where a + 0.5 would round for small a)."""
    r = torch.floor(a)
    return r.add_(a.sub_(r).ge_(0.5).to(r.dtype))


def round_magnitude_(a: torch.Tensor, p: ElemParams, rounding: str,
                     noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Round non-negative float32 magnitudes onto the format grid, without saturation, IN PLACE
    (``a`` is overwritten and returned; few temporaries keep the eager path fast).

    ``noise`` (uniform [0, 1), same shape) is required for rounding="stochastic".
    """
    if rounding == "nearest_even" and adder_rounds(p):
        return _round_nearest_even_(a, p)
    if rounding == "nearest_away" and _bits_round_away(p):
        return _round_tapered_away(a, p)
    e = grid_exponent(a, p.grid_emin, p.grid_emax)
    m = _mantissa_bits(e, p)
    # q = a * 2^(m - e) with one power of two when both powers are normal floats; otherwise
    # split as 2^(1-e) * 2^(m-1)
    single = powers_are_normal(p)
    if single:
        to_grid_steps_(a, e, m)
        down = None
    else:
        a.mul_(((128 - e) << 23).view(torch.float32))
        a.mul_(2.0 ** (m - 1))
        down = 2.0 ** (-m)
    if rounding == "nearest_even":
        a.round_()
    elif rounding == "nearest_away":
        a = round_ties_away_(a)
    elif rounding in ("stochastic", "hybrid"):
        r = torch.floor(a)
        frac = a.sub_(r)
        if noise is None:
            raise ValueError(f"{rounding} rounding needs uniform noise")
        up = noise < frac
        if rounding == "hybrid":  # HiF8: ties away for |E| <= 3, stochastic for |E| >= 4
            up = torch.where(e.abs() >= 4, up, frac >= 0.5)
        a = r.add_(up.to(r.dtype))
    elif rounding == "toward_zero":
        a.floor_()
    else:  # validated by the caller; kept as a guard for direct use
        raise ValueError(f"unknown rounding mode {rounding!r}")
    if single:
        return from_grid_steps_(a, e, m)
    a.mul_(down)
    return a.mul_(e.add_(127).bitwise_left_shift_(23).view(torch.float32))


def adder_rounds(p: ElemParams) -> bool:
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


def _bits_round_away(p: ElemParams) -> bool:
    """Whether ties-away rounding can add half a step to the bits (:func:`_round_tapered_away`):
    the tapered grid (HiF8), whose lowest binade has no mantissa bits (tested), so below it lie
    only 0 and 2^grid_emin."""
    return p.tapered


def _round_tapered_away(a: torch.Tensor, p: ElemParams) -> torch.Tensor:
    """round_magnitude_'s nearest_away on a tapered grid from the float's bits (the same values,
    about half the vector ops of floor, compare and convert; HiF8's default rounding).

    A magnitude in a grid binade e keeps its top m(e) mantissa bits: adding half of the dropped
    part to the bits and clearing it rounds half away from zero, and a carry into the exponent
    gives the next power of two, which is on the grid. Below 2^grid_emin the grid holds only 0
    and 2^grid_emin (the tie 2^(grid_emin - 1) goes up); NaN stays NaN. Only a magnitude of
    2^(grid_emax + 1) or more (beyond max_normal) may come out otherwise than by
    multiply-round-multiply (a power of two or Inf, still beyond max_normal): saturation,
    overflow encoding and every overflow test see the same."""
    bits = a.view(torch.int32)
    drop = 23 - tapered_mantissa_bits(grid_exponent(a, p.grid_emin, p.grid_emax))
    half = torch.ones_like(drop) << (drop - 1)
    r = ((bits + half) & -(half << 1)).view(torch.float32)
    bottom = 2.0 ** p.grid_emin
    r = torch.where(a < bottom, torch.where(a >= bottom / 2, bottom, 0.0), r)
    return torch.where(a == a, r, a)


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
    return r if p.signed_zero else single_zero_(r)


def single_zero_(r: torch.Tensor) -> torch.Tensor:
    """-0 -> +0 in place, for formats with a single zero code (HiF8)."""
    return r.add_(0.0)


def cast_elements(x: torch.Tensor, p: ElemParams, rounding: str, saturate: bool,
                  noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Fake-quantize float32 x element by element (no scaling)."""
    return finish(round_magnitude_(x.abs(), p, rounding, noise), x, p, saturate)


@dataclass(frozen=True)
class RowParams:
    """ElemParams of several formats, one per row of a stacked [F, ...] tensor: the grid
    constants as [F, 1, ..., 1] columns, and the rows that need HiF8's tapered mantissa, ties
    away from zero or a single zero (that work runs on those rows alone)."""

    grid_emin: torch.Tensor
    grid_emax: torch.Tensor
    mbits: torch.Tensor
    max_normal: torch.Tensor
    tapered: tuple
    ties_away: tuple
    single_zero: tuple

    @staticmethod
    def stack(params: Sequence[ElemParams], roundings: Sequence[str], ndim: int,
              device: torch.device) -> "RowParams":
        """Rows of ``params`` rounded by ``roundings`` ("nearest_even" / "nearest_away") for a
        stacked tensor of ``ndim`` dimensions; every format must have powers_are_normal."""
        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device).reshape(-1, *[1] * (ndim - 1))
        return RowParams(
            col([p.grid_emin for p in params], torch.int32),
            col([p.grid_emax for p in params], torch.int32),
            col([p.mbits for p in params], torch.int32),
            col([p.max_normal for p in params], torch.float32),
            tuple(i for i, p in enumerate(params) if p.tapered),
            tuple(i for i, r in enumerate(roundings) if r == "nearest_away"),
            tuple(i for i, p in enumerate(params) if not p.signed_zero))


def cast_rows_(a: torch.Tensor, x: torch.Tensor, rp: RowParams):
    """cast_elements (saturating) of every row of x [F, ...] with its own format of ``rp``, at
    once: the same float32 operations as round_magnitude_ then finish, element for element (the
    adder's nearest-even rounding takes the same values as multiply-round-multiply). ``a`` is
    |x| and is overwritten. Returns (cast values, overflow: the rounded magnitude is beyond
    max_normal, before saturation)."""
    e = grid_exponent(a, rp.grid_emin, rp.grid_emax)
    m = rp.mbits
    if rp.tapered:
        m = m.expand(e.shape).clone()
        for i in rp.tapered:
            m[i] = tapered_mantissa_bits(e[i])
    to_grid_steps_(a, e, m)
    away = [(i, round_ties_away_(a[i])) for i in rp.ties_away]
    r = a.round_()
    for i, t in away:
        r[i] = t
    r = from_grid_steps_(r, e, m)
    over = r > rp.max_normal
    r = r.clamp_(max=rp.max_normal).copysign_(x)
    for i in rp.single_zero:
        single_zero_(r[i])
    return r, over
