"""Pre-quantization analysis and THE definitions of overflow, underflow, flush-to-zero,
saturation and severity that every tool uses (capture statistics, the sweep, the analyzer, the
monitor). docs/quant.md states them; ``tests/test_numerics_truth.py`` feeds one tensor to every
path.

Definitions (counts are over the elements considered; ratios divide by their number):
- overflow: +-Inf inputs, and finite values whose magnitude, after the format's scale, rounds
  beyond max_normal under the format's rounding (an element cast: ``|x| > overflow_from``, or
  ``==`` when the tie rounds up; see :class:`CastLimits`);
- saturation: what an overflowing value becomes with ``saturate=True``: +-max_normal (with
  ``saturate=False`` it becomes Inf, NaN or is clamped, per the format's encodings);
- underflow: finite nonzero values whose scaled magnitude is below the element's min_normal
  (they land in the subnormal range or flush to zero);
- flush_to_zero: finite nonzero values that quantize to 0 (a subset of underflow);
- severity of a ratio: ``high`` above 1 %, ``medium`` above 0.1 %, else
  ``none``; overflow severity from the overflow ratio, underflow severity from the underflow
  ratio, flush-to-zero severity from the flush-to-zero ratio.
"Scaled" means after the block / tensor scale the format applies (MX, NVFP4, *_tensor).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Any, Optional, Union

import torch

from .elemwise import ElemParams, round_magnitude
from .formats import FormatSpec, format_for_dtype, get_format
from .layout import to_blocks
from .quantizer import Quantizer, check_input
from .severity import (  # noqa: F401  (the analysis' severity names, defined once there)
    HIGH_THRESHOLD,
    MEDIUM_THRESHOLD,
    SEVERITIES,
    SEVERITY_HIGH,
    SEVERITY_MEDIUM,
    SEVERITY_NONE,
    severity,
    severity_label,
)

#: rounding modes whose overflow is judged by their nearest-rounding outcome
_ANALYSIS_ROUNDING = {"stochastic": "nearest_even", "hybrid": "nearest_away"}



@dataclass(frozen=True)
class CastLimits:
    """Where an element cast (no scale) of a magnitude overflows, underflows and flushes.

    overflow: ``|x| > overflow_from``, or ``|x| == overflow_from`` when ``overflow_inclusive``
    (+-Inf always); underflow: ``0 < |x| < min_normal``; flush to zero: ``0 < |x| < flush_to``,
    or ``== flush_to`` when ``flush_inclusive``. For round-to-nearest ``overflow_from`` is the
    midpoint between max_normal and the next grid value and ``flush_to`` half the smallest
    subnormal; the tie flags say which way the format's rounding sends the midpoint.
    """

    name: str
    max_normal: float
    min_normal: float
    min_subnormal: float
    overflow_from: float = math.inf
    overflow_inclusive: bool = False
    flush_to: float = 0.0
    flush_inclusive: bool = False

    def overflow_bound(self, dtype: torch.dtype) -> float:
        """Smallest magnitude representable in ``dtype`` that overflows (inf: only Inf)."""
        return _least_value(self.overflow_from, dtype, strict=not self.overflow_inclusive)

    def underflow_bound(self, dtype: torch.dtype) -> float:
        """Smallest magnitude representable in ``dtype`` that does not underflow."""
        return _least_value(self.min_normal, dtype, strict=False)

    def flush_bound(self, dtype: torch.dtype) -> float:
        """Smallest magnitude representable in ``dtype`` that does not flush: a nonzero
        ``|x|`` of that dtype flushes iff it is below this."""
        return _least_value(self.flush_to, dtype, strict=self.flush_inclusive)


def _least_value(t: float, dtype: torch.dtype, strict: bool) -> float:
    """Smallest value of ``dtype`` that is >= t (> t when ``strict``)."""
    if math.isinf(t):
        return t
    v = torch.tensor(t, dtype=torch.float64).to(dtype)
    if float(v) < t or (strict and float(v) == t):
        v = torch.nextafter(v, torch.tensor(math.inf, dtype=dtype))
    return float(v)


def _grid_step_at_max(spec: FormatSpec) -> float:
    """Spacing of the element grid at max_normal, read from the rounding kernel."""
    p = ElemParams.of(spec)
    above = torch.nextafter(torch.tensor([spec.max_normal], dtype=torch.float32),
                            torch.tensor([math.inf]))
    nxt = float(round_magnitude(above, p, "stochastic", torch.zeros(1)))  # rounds up
    if math.isinf(nxt):  # next value is beyond float32 (bf16): the next power of two
        nxt = 2.0 ** (math.floor(math.log2(spec.max_normal)) + 1)
    return nxt - spec.max_normal


@lru_cache(maxsize=None)
def cast_limits(fmt: Union[str, FormatSpec], rounding: Optional[str] = None) -> CastLimits:
    """The :class:`CastLimits` of a format's element cast under ``rounding`` (None: the
    format's default; stochastic is judged as nearest_even, hybrid as nearest_away)."""
    spec = get_format(fmt)
    mode = rounding or spec.default_rounding
    mode = _ANALYSIS_ROUNDING.get(mode, mode)
    step, sub = _grid_step_at_max(spec), spec.min_subnormal
    if mode == "toward_zero":
        over, over_tie, flush, flush_tie = spec.max_normal + step, True, sub, False
    else:
        odd_top = round(spec.max_normal / step) % 2 == 1   # RNE sends the tie to the even side
        over, flush = spec.max_normal + step / 2, sub / 2
        over_tie = mode == "nearest_away" or odd_top
        flush_tie = mode == "nearest_even"                  # 0 is even; away goes up to sub
    return CastLimits(spec.name, spec.max_normal, spec.min_normal, sub, over, over_tie, flush,
                      flush_tie)


def dtype_limits(dtype: torch.dtype) -> Optional[CastLimits]:
    """CastLimits of a torch floating dtype: bf16 / fp16 / fp32 from the format table, other
    floating dtypes (float64) from torch.finfo with IEEE round-to-nearest-even; None otherwise."""
    name = format_for_dtype(dtype)
    label = str(dtype).replace("torch.", "")
    if name is not None:
        return replace(cast_limits(name), name=label)
    if not dtype.is_floating_point:
        return None
    fi = torch.finfo(dtype)
    ulp_top = float(fi.max) * float(fi.eps) / (2 - float(fi.eps))   # spacing at max
    sub = float(fi.tiny) * float(fi.eps)
    return CastLimits(label, float(fi.max), float(fi.tiny), sub, float(fi.max) + ulp_top / 2,
                      True, sub / 2, True)


@dataclass
class QuantAnalysis:
    """Result of analyze_quantization (see the module docstring for the definitions)."""

    format: str
    total: int
    nonzero: int
    nan_count: int
    inf_count: int
    overflow_count: int
    underflow_count: int
    flush_to_zero_count: int
    overflow_ratio: float
    underflow_ratio: float
    flush_to_zero_ratio: float
    overflow_severity: str
    underflow_severity: str        # from the underflow ratio (what the warning uses)
    range_before: tuple            # (min, max) over finite input values
    range_after: tuple             # (min, max) over finite quantized values
    absmax_before: float
    absmax_after: float
    min_nonzero_before: float      # smallest finite nonzero |x| (nan when none)
    min_nonzero_after: float
    max_normal: float
    min_normal: float
    min_subnormal: float
    block_size: Optional[int] = None
    flush_to_zero_severity: str = SEVERITY_NONE
    nan_blocks: int = 0            # blocks turned NaN by a NaN/Inf inside them
    # per block ([rows, nblocks], block axis moved last): counts and the scale of each block
    per_block: Optional[dict] = field(default=None, repr=False)

    def to_dict(self, include_blocks: bool = False) -> dict:
        """Plain JSON-ready values; per-block tensors become nested lists when asked for."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "per_block"}
        d["range_before"], d["range_after"] = list(self.range_before), list(self.range_after)
        if include_blocks and self.per_block is not None:
            d["per_block"] = {k: v.tolist() for k, v in self.per_block.items()}
        return d

    def warning_message(self) -> Optional[str]:
        """The original analysis script's underflow warning when underflow exceeds 0.1 %, else None."""
        if self.underflow_severity == SEVERITY_NONE:
            return None
        icon = "🔴" if self.underflow_severity == SEVERITY_HIGH else "🟡"
        sev = severity_label(self.underflow_severity)
        lo, hi = self.range_before
        return (f"{icon} UNDERFLOW WARNING before {self.format} quantization "
                f"(severity {sev}):\n"
                f"    Underflow: {self.underflow_count} ({self.underflow_ratio:.2%})\n"
                f"    Flush to Zero: {self.flush_to_zero_count} "
                f"({self.flush_to_zero_ratio:.2%})\n"
                f"    Overflow: {self.overflow_count} ({self.overflow_ratio:.2%})\n"
                f"    Min Normal: {self.min_normal:.2e}\n"
                f"    Tensor Range: [{lo:.2e}, {hi:.2e}]\n"
                f"    Severity: {sev}")


def _range_summary(t: torch.Tensor) -> tuple[tuple[float, float], float, float]:
    """((min, max), absmax, smallest nonzero magnitude) over the finite values; NaN when none.

    One pass per statistic with torch.where (no boolean-index copies): it runs on every
    operand the emulation's underflow warning analyses."""
    fin = torch.isfinite(t)
    a = t.abs()
    inf = torch.tensor(float("inf"), dtype=t.dtype, device=t.device)
    lo = float(torch.where(fin, t, inf).amin())
    hi = float(torch.where(fin, t, -inf).amax())
    amax = float(torch.where(fin, a, -inf).amax())
    mnz = float(torch.where(fin & (a > 0), a, inf).amin())
    nan = float("nan")
    if lo == float("inf"):          # no finite value at all
        return (nan, nan), nan, nan
    return (lo, hi), amax, (mnz if mnz != float("inf") else nan)


def _scaled_layout(x32, q: Quantizer):
    """Scaled values in the layout the format works in (its family's Scales), plus per-block
    scales and a restorer.

    Returns (v, scales or None, restore or None, block_finite or None).
    """
    family = q.family
    if not family.blocked:
        return family.scales(x32, q.spec, q.scale_mode).encoded(x32), None, None, None
    xb, restore = to_blocks(x32, q.axis, q.block)
    s = family.scales(xb, q.spec, q.scale_mode)
    return s.encoded(xb), s.block_scale, restore, ~s.poisoned


def _element_masks(x32, q: Quantizer):
    """Per element: would it overflow, does it underflow, after the format's scales (the
    module docstring's definitions, before zeros and NaN/Inf inputs are dropped). Returns
    (overflow, underflow, per-block scales or None, per-block finite mask or None)."""
    spec = q.spec
    v, scales, restore, block_finite = _scaled_layout(x32, q)
    av = v.abs()
    mode = _ANALYSIS_ROUNDING.get(q.rounding, q.rounding)
    over_v = round_magnitude(av, q.params, mode) > spec.max_normal
    under_v = av < spec.min_normal
    if restore is not None:
        # elements of a NaN/Inf-poisoned block are NaN, not over/underflowed (nan_blocks)
        ok = block_finite.expand_as(v)
        over_v, under_v = restore(over_v & ok), restore(under_v & ok)
    if spec.is_identity:
        over_v = torch.zeros_like(over_v)
        under_v = x32.abs() < spec.min_normal
    return over_v, under_v, scales, block_finite


@dataclass
class _Masks:
    """What analyze_quantization counts, per element (and per block for block formats)."""

    overflow: torch.Tensor
    underflow: torch.Tensor
    ftz: torch.Tensor
    nonzero: torch.Tensor
    inf: torch.Tensor
    per_block: Optional[dict] = None
    nan_blocks: int = 0


def _masks(x32: torch.Tensor, y32: torch.Tensor, q: Quantizer) -> _Masks:
    """The element masks of the module docstring's definitions (x32 at least 1-D)."""
    finite = torch.isfinite(x32)
    nonzero = finite & (x32 != 0)
    inf_mask = torch.isinf(x32)
    over_el, under_el, scales, block_finite = _element_masks(x32, q)
    m = _Masks(overflow=inf_mask | (finite & over_el), underflow=nonzero & under_el,
               ftz=nonzero & (y32 == 0), nonzero=nonzero, inf=inf_mask)
    if block_finite is not None:
        def blocks_of(mask):
            b, _ = to_blocks(mask.to(torch.int32), q.axis, q.block)
            return b.sum(dim=-1)
        m.per_block = {"overflow": blocks_of(m.overflow), "underflow": blocks_of(m.underflow),
                       "flush_to_zero": blocks_of(m.ftz), "scale": scales.squeeze(-1)}
        m.nan_blocks = int((~block_finite).sum())
    return m


def analyze_quantization(x: torch.Tensor, fmt: Union[str, FormatSpec, Quantizer], *,
                         quantized: Optional[torch.Tensor] = None, summaries: bool = True,
                         **options: Any) -> QuantAnalysis:
    """Count overflow / underflow / flush-to-zero of quantizing ``x`` to ``fmt``.

    Same options as quantize() (or a configured Quantizer as ``fmt``, which carries them); pass
    ``quantized`` (the result of quantize with those options)
    to avoid quantizing twice. Stochastic (hybrid) rounding is analysed with its nearest-even
    (nearest-away) outcome for overflow; flush-to-zero always comes from the actual quantized
    values. ``summaries=False`` skips the range / absmax / smallest-nonzero summaries before
    and after (NaN in the result): the counts alone, for callers that run per tensor and per
    format (what-if numerics at capture).
    """
    check_input(x, "analyze_quantization")
    q = Quantizer.resolve(fmt, "analyze_quantization", **options)
    with torch.no_grad():
        x = x.detach()
        if quantized is None:
            quantized = q(x)
        if quantized.shape != x.shape:
            raise ValueError(f"analyze_quantization: quantized has shape "
                             f"{tuple(quantized.shape)}, x has {tuple(x.shape)}")
        x32, y32 = x.float(), quantized.detach().float()
        if x32.dim() == 0:
            x32, y32, q = x32.reshape(1), y32.reshape(1), q.along(0)
        m = _masks(x32, y32, q)
        # one conversion for every count (each int() of a tensor is a host round trip)
        counts = torch.stack([m.overflow.sum(), m.underflow.sum(), m.ftz.sum(),
                              m.nonzero.sum(), m.inf.sum()]).tolist()
        nan = float("nan")
        ranges = ((_range_summary(x32), _range_summary(y32)) if summaries
                  else (((nan, nan), nan, nan),) * 2)
        return _report(q, x32, m, [int(c) for c in counts], ranges)


def _report(q: Quantizer, x32: torch.Tensor, m: _Masks, counts: list,
            ranges: tuple) -> QuantAnalysis:
    """The QuantAnalysis of the counts (overflow, underflow, flush, nonzero, Inf)."""
    spec, total = q.spec, x32.numel()
    n_over, n_under, n_ftz, n_nonzero, n_inf = counts
    before, after = ranges
    return QuantAnalysis(
        format=spec.name, total=total, nonzero=n_nonzero,
        nan_count=int(torch.isnan(x32).sum()), inf_count=n_inf, overflow_count=n_over,
        underflow_count=n_under, flush_to_zero_count=n_ftz, overflow_ratio=n_over / total,
        underflow_ratio=n_under / total, flush_to_zero_ratio=n_ftz / total,
        overflow_severity=severity(n_over / total),
        underflow_severity=severity(n_under / total),
        flush_to_zero_severity=severity(n_ftz / total),
        range_before=before[0], range_after=after[0], absmax_before=before[1],
        absmax_after=after[1], min_nonzero_before=before[2], min_nonzero_after=after[2],
        max_normal=spec.max_normal, min_normal=spec.min_normal,
        min_subnormal=spec.min_subnormal, block_size=q.block or None,
        nan_blocks=m.nan_blocks, per_block=m.per_block)


def warn_if_underflow(report: QuantAnalysis, stream=None) -> Optional[str]:
    """Print the underflow warning when underflow exceeds 0.1 % (stderr by default)."""
    msg = report.warning_message()
    if msg is not None:
        print(msg, file=stream if stream is not None else sys.stderr, flush=True)
    return msg
