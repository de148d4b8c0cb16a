"""The scale sweep's inputs: the element grid, the prepared tensor and the levels to sweep.

Why a module of its own: choosing what to sweep (the alignment exponents of a tensor against a
format, the clipped and widened level range, the notes saying why) is independent of the
batched pass that measures each level (quant.scaling_sweep), and both stay readable apart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from . import sweep_verdicts
from .elemwise import round_magnitude_
from .family_tensor import TENSOR
from .formats import FormatSpec, element_formats, get_format
from .quantizer import Quantizer
from .scales import Scales, cast_scaled

#: element formats the sweep accepts (the ``--elem-format`` choices): those with an MX format
ELEMENT_FORMATS = element_formats()


class SweepInputError(ValueError):
    """A user mistake in the sweep's input (message is one line, says the fix)."""


# --------------------------------------------------------------------------------------
# element grid from the format spec


@dataclass(frozen=True)
class ElementGrid:
    """The sweep's view of an element format (quant.formats' FormatSpec): its range, and the
    facts the batched counts need. The cast is the element cast of ``quantizer`` (the format's
    quant.quantizer.Quantizer, nearest even and saturating: quant.elemwise's one cast).

    Floats: values are multiples of ``2^(max(e, emin) - mbits)`` for binade ``e``;
    integers (fixed point): multiples of ``step``. ``max_normal`` saturates.
    """

    name: str
    max_normal: float
    min_normal: float
    min_subnormal: float
    mbits: int
    emin: int          # exponent of min_normal (floats)
    is_int: bool
    step: float        # grid step (ints); min_subnormal for floats
    ebits: int = 0
    #: the sweep's element cast (quant.quantizer: nearest even, saturating), configured once
    quantizer: Optional[Quantizer] = None

    @property
    def layout(self) -> str:
        """``e4m3``-style bit layout, or the fixed-point step for integers."""
        if self.is_int:
            return f"fixed point, step 2^{int(math.log2(self.step))}"
        return f"e{self.ebits}m{self.mbits}"

    @property
    def overflow_cap(self) -> float:
        """A power of two above max_normal: values beyond it overflow whatever the rounding;
        clamping to it keeps the cast's float32 arithmetic in range."""
        return 2.0 ** (math.floor(math.log2(self.max_normal)) + 1)

    @property
    def max_exact_chunk(self) -> int:
        """Longest row whose float32 sum of values in {max_normal, max_normal + top_step} is
        exact (both are multiples of top_step; keep the total under 2^23 steps)."""
        return max(256, int(2 ** 23 * self.top_step / (self.max_normal + self.top_step)))

    @property
    def top_step(self) -> float:
        """Grid spacing at max_normal: the gap to the first value that counts as overflow."""
        if self.is_int:
            return self.step
        return 2.0 ** (math.floor(math.log2(self.max_normal)) - self.mbits)

    def round_(self, a: torch.Tensor) -> torch.Tensor:
        """Round non-negative float32 magnitudes ``a`` (at most ``overflow_cap``) onto the grid
        to nearest even, in place, without saturation (quant.elemwise.round_magnitude_)."""
        return round_magnitude_(a, self.quantizer.params, self.quantizer.rounding)


def element_grid(spec: FormatSpec, name: str | None = None) -> ElementGrid:
    """Read the element format's range and precision from a ``quant`` FormatSpec."""
    name = name or spec.name
    maxn, minn = float(spec.max_normal), float(spec.min_normal)
    minsub = float(spec.min_subnormal or minn)
    ebits, mbits = int(spec.ebits or 0), int(spec.mbits)
    quantizer = Quantizer.of(spec, rounding="nearest_even")
    if ebits == 0:  # fixed point: uniform grid
        return ElementGrid(name, maxn, minn, minsub, mbits, 0, True, minsub, 0, quantizer)
    emin = int(round(math.log2(minn)))
    if 2.0 ** emin != minn or mbits > 22:
        raise ValueError(f"{name}: min_normal {minn} is not a power of two or mbits {mbits} > 22")
    return ElementGrid(name, maxn, minn, minsub, mbits, emin, False, minsub, ebits, quantizer)


def cast_elements(v: torch.Tensor, grid: ElementGrid) -> torch.Tensor:
    """Cast already-scaled float32 values to the element format (saturating, RNE)."""
    return cast_scaled(v.to(torch.float32), Scales(), grid.quantizer)


def cast_levels(x: torch.Tensor, factors: torch.Tensor, grid: ElementGrid) -> torch.Tensor:
    """Fake-quantize ``x`` (1-D float32) at every scale factor: returns ``[levels, n]``.

    Row ``i`` equals ``quant.quantize(x / factors[i], fmt) * factors[i]``. Small inputs only
    (it materializes all rows); the sweep itself never does.
    """
    s = TENSOR.levels(factors)
    q = grid.quantizer
    return cast_scaled(x.to(torch.float32)[None, :], s, q)


# --------------------------------------------------------------------------------------
# input preparation and levels


@dataclass
class PreparedTensor:
    """The finite values of a tensor as flat float32, plus what was excluded."""

    values: torch.Tensor
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nan_count: int
    inf_count: int

    @property
    def finite_count(self) -> int:
        return int(self.values.numel())


def prepare_tensor(t: Any, source: str = "input") -> PreparedTensor:
    """Validate and flatten a tensor for the sweep; NaN/Inf are counted and dropped.

    Fast path: ``amin``/``amax`` propagate NaN and Inf, so two reductions prove a tensor
    finite; the masks are built only when they do not.
    """
    if not isinstance(t, torch.Tensor):
        raise SweepInputError(f"{source}: holds a {type(t).__name__}, not a tensor")
    if t.is_complex() or not t.is_floating_point():
        raise SweepInputError(
            f"{source}: holds a {str(t.dtype).replace('torch.', '')} tensor; the sweep needs "
            "floating-point values (save it as bf16/fp16/fp32, e.g. t.to(torch.bfloat16))")
    if t.numel() == 0:
        raise SweepInputError(f"{source}: the tensor is empty (shape {tuple(t.shape)}); "
                              "pass a tensor with at least one element")
    flat = t.detach().reshape(-1).cpu()       # the sweep's kernels run on the CPU
    if flat.dtype != torch.float32:
        flat = flat.to(torch.float32)
    nan_count = inf_count = 0
    if math.isfinite(float(flat.amax())) and math.isfinite(float(flat.amin())):
        values = flat
    else:
        wide = t.detach().reshape(-1).cpu()
        if wide.dtype == torch.float64 and \
                int(torch.isfinite(wide).sum()) != int(torch.isfinite(flat).sum()):
            big = float(wide[torch.isfinite(wide)].abs().max())
            raise SweepInputError(f"{source}: float64 values beyond the float32 range (max |x| "
                                  f"{big:.3e}); the sweep works in float32: rescale the tensor "
                                  "or save it as float32/bf16")
        finite = torch.isfinite(flat)
        nan_count = int(torch.isnan(flat).sum())
        n_finite = int(finite.sum())
        inf_count = int(flat.numel() - n_finite - nan_count)
        if n_finite == 0:
            raise SweepInputError(f"{source}: all {flat.numel()} values are NaN or Inf "
                                  f"({nan_count} NaN); nothing finite to sweep")
        values = flat[finite]
    values = values.contiguous()
    return PreparedTensor(values, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                          int(t.numel()), nan_count, inf_count)


@dataclass
class Alignment:
    """The two alignment exponents, or None where undefined (all values zero)."""

    max_align: int | None      # floor(log2(amax / max_normal))
    min_align: int | None      # ceil(log2(min_nonzero / min_normal))
    amax: float
    amin_nonzero: float | None


def floor_log2(r: float) -> int:
    """Exact floor(log2(r)) for r > 0 (from the float's exponent, no log rounding)."""
    mant, exp = math.frexp(r)          # r = mant * 2^exp, 0.5 <= mant < 1
    return exp - 1


def ceil_log2(r: float) -> int:
    """Exact ceil(log2(r)) for r > 0."""
    mant, exp = math.frexp(r)
    return exp - 1 if mant == 0.5 else exp


def min_nonzero_abs(values: torch.Tensor) -> float | None:
    """Smallest non-zero |x| of finite float32 values, or None when all are zero.

    On the bits: ``|x|``'s int32 pattern orders like the value; ``bits - 1`` maps zero to -1,
    and masking the sign bit turns that into the largest int, out of the minimum's way.
    """
    bits = values.view(torch.int32) & 0x7FFFFFFF
    m = int(bits.sub_(1).bitwise_and_(0x7FFFFFFF).amin()) + 1
    if m == 0x7FFFFFFF + 1:
        return None
    return float(torch.tensor([m], dtype=torch.int32).view(torch.float32))


def alignment_exponents(values: torch.Tensor, grid: ElementGrid) -> Alignment:
    """Max alignment ``floor(log2(amax/max_normal))``; min alignment
    ``ceil(log2(min_nonzero/min_normal))`` over finite non-zero values; both exact (the
    ratio is formed in float64, where it cannot cross a power of two, then read with frexp)."""
    if values.numel() == 0:
        return Alignment(None, None, 0.0, None)
    amax = max(-float(values.amin()), float(values.amax()))
    amin = min_nonzero_abs(values)
    if amin is None or amax == 0.0:
        return Alignment(None, None, amax, None)
    max_align = floor_log2(amax / grid.max_normal)
    min_align = ceil_log2(amin / grid.min_normal)
    return Alignment(max_align, min_align, amax, amin)


def scale_exponent_limits(scale_bits: int) -> tuple[int, int]:
    """Exponent range of an unsigned E{k}M0 scale (bias 2^(k-1)-1, all-ones code = NaN)."""
    if scale_bits < 2 or scale_bits > 8:
        raise SweepInputError(f"--scale-bits {scale_bits}: must be between 2 and 8 "
                              "(an E8M0 scale has 8); pass e.g. --scale-bits 8")
    bias = 2 ** (scale_bits - 1) - 1
    return -bias, (2 ** scale_bits - 2) - bias


@dataclass
class LevelPlan:
    """The exponents to sweep and how they were chosen."""

    levels: list[float]
    max_exp: float
    min_exp: float
    alignment: Alignment
    notes: list[str] = field(default_factory=list)
    #: why fewer than sweep_verdicts.MIN_CURVE_LEVELS levels were swept ("" when not)
    sparse_reason: str = ""


def plan_levels(values: torch.Tensor, grid: ElementGrid, *, num_levels: int = 21,
                max_scale_exp: float | None = None, min_scale_exp: float | None = None,
                scale_bits: int = 8) -> LevelPlan:
    """Choose ``num_levels`` evenly spaced exponents from ``min_exp`` to ``max_exp``.

    Defaults come from the alignments; an all-zero tensor has none, so the defaults are
    max 0 and min = -(the format's normal span in binades), said in ``notes``. When both
    bounds are automatic and the tensor's range is narrower than the format's (min
    alignment above max alignment), the two are swapped: every level between is then free
    of both overflow and underflow. When both bounds are automatic and the alignments meet
    (one exponent: the tensor's range is exactly as wide as the format's), the range is
    widened to that exponent +- ceil(span / 2), span = ceil(log2(max_normal / min_normal)),
    the width the all-zero default also uses, so a sweep never collapses to one point unasked
    (a recommendation compares levels). Levels beyond the E{scale_bits}M0 range are clipped.
    """
    if num_levels < 1:
        raise SweepInputError(f"--num-levels {num_levels}: must be at least 1 (default 21)")
    for flag, val in (("--max-scale-exp", max_scale_exp), ("--min-scale-exp", min_scale_exp)):
        if val is not None and not math.isfinite(val):
            raise SweepInputError(f"{flag} {val}: must be a finite number")
    lo_lim, hi_lim = scale_exponent_limits(scale_bits)
    al = alignment_exponents(values, grid)
    notes: list[str] = []
    span = math.ceil(math.log2(grid.max_normal / grid.min_normal)) if grid.min_normal > 0 else 8
    auto_max = al.max_align
    auto_min = al.min_align
    if auto_max is None or auto_min is None:
        notes.append("all values are zero: no max/min alignment exists; using defaults "
                     f"max 0 and min {-span} (the format's normal range in binades)")
        auto_max, auto_min = 0, -max(span, 1)
    if max_scale_exp is None and min_scale_exp is None and auto_min > auto_max:
        notes.append(f"min alignment {auto_min} is above max alignment {auto_max} (the tensor's "
                     "range fits inside the format's normal range); sweeping between them")
        auto_max, auto_min = auto_min, auto_max
    if max_scale_exp is None and min_scale_exp is None and auto_min == auto_max and num_levels > 1:
        half = max(1, math.ceil(span / 2))
        notes.append(f"max and min alignment are both {auto_max} (the tensor's range is as wide "
                     "as the format's normal range): one exponent cannot be compared with "
                     f"anything, so the sweep is widened by ceil({span} binades / 2) = {half} on "
                     f"each side to [{auto_max - half}, {auto_max + half}]")
        auto_max, auto_min = auto_max + half, auto_min - half
    max_exp = float(auto_max if max_scale_exp is None else max_scale_exp)
    min_exp = float(auto_min if min_scale_exp is None else min_scale_exp)
    if min_exp > max_exp:
        src = lambda v, user: "given" if user is not None else "automatic"  # noqa: E731
        raise SweepInputError(
            f"--min-scale-exp {min_exp:g} ({src(min_exp, min_scale_exp)}) is greater than "
            f"--max-scale-exp {max_exp:g} ({src(max_exp, max_scale_exp)}); pass a smaller "
            "--min-scale-exp or a larger --max-scale-exp")
    clipped_max, clipped_min = min(max(max_exp, lo_lim), hi_lim), min(max(min_exp, lo_lim), hi_lim)
    if (clipped_max, clipped_min) != (max_exp, min_exp):
        notes.append(f"exponents clipped to the {scale_bits}-bit scale range [{lo_lim}, {hi_lim}]: "
                     f"[{min_exp:g}, {max_exp:g}] -> [{clipped_min:g}, {clipped_max:g}]")
        max_exp, min_exp = clipped_max, clipped_min
    if num_levels == 1 or max_exp == min_exp:
        levels = [max_exp] * (1 if max_exp == min_exp else num_levels)
        levels = sorted(set(levels))
    else:
        levels = torch.linspace(min_exp, max_exp, num_levels, dtype=torch.float64).tolist()
    sparse = ""
    if len(levels) < sweep_verdicts.MIN_CURVE_LEVELS:
        given = [f for f, v in (("--min-scale-exp", min_scale_exp),
                                ("--max-scale-exp", max_scale_exp)) if v is not None]
        if num_levels < sweep_verdicts.MIN_CURVE_LEVELS:
            sparse = f"--num-levels {num_levels} asked for"
        elif any("clipped" in n for n in notes):
            sparse = f"both ends were clipped to the {scale_bits}-bit scale limit {max_exp:g}"
        else:
            sparse = ("--min-scale-exp and --max-scale-exp are both " if len(given) == 2 else
                      f"{given[0]} equals the automatic other end, " if given else
                      "the range is the single exponent ") + f"{max_exp:g}"
        notes.append(f"{len(levels)} level(s) swept: {sparse}")
    return LevelPlan(levels, max_exp, min_exp, al, notes, sparse)


def scale_factors(levels: Sequence[float]) -> torch.Tensor:
    """float32(2**s) for each level (the exact factor the sweep divides and multiplies by)."""
    return TENSOR.level_factors(levels)


def get_element_grid(elem_format: str) -> ElementGrid:
    """The element grid of one of ``ELEMENT_FORMATS`` from ``quant.get_format``."""
    if elem_format not in ELEMENT_FORMATS:
        raise SweepInputError(f"--elem-format {elem_format!r}: not supported; choose one of "
                              + ", ".join(ELEMENT_FORMATS))
    return element_grid(get_format(elem_format), elem_format)
