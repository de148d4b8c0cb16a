"""MXFP scale sweep: how one power-of-two scale per tensor changes quantization error.

Why: an MX block scale is ``2^(floor(log2 amax_block) - emax_elem)``. Before trusting that
rule for a tensor, a researcher wants to see the whole curve: every scale exponent from
the one that aligns the tensor's largest magnitude with the element format's max normal
(no overflow) to the one that aligns its smallest non-zero magnitude with the min normal
(no underflow), and the error at each.

How a level is applied (exactly, in float32): for scale exponent ``s`` (fractional values
allowed) the factor is ``f = float32(2**s)``; the tensor ``x`` is divided by ``f``, cast
element-wise to the element format (round to nearest even, saturating at +-max_normal, the
same cast as ``quant.quantize(x / f, fmt)``), and multiplied back by ``f``. Larger ``s``
means smaller scaled values. For integer ``s`` within the E8M0 range this is exactly one MX
block whose shared scale is ``2^s``, applied to the whole tensor; the MX rule would pick
``s = floor(log2 amax) - emax_elem`` (per block of 32), which is the max-alignment level
here up to one binade (``emax_elem`` vs ``log2 max_normal``).

All levels are computed in one batched pass over chunks of the tensor (``[levels, chunk]``
tiles), accumulating per-level sufficient statistics in float64; metric values are then
formed with the definitions of ``quant.metrics`` (the tests check every level against
``quant.metrics``, ``quant.quantize`` and ``quant.analyze_quantization``). Pure torch.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from . import sweep_verdicts
from .analysis import severity as _severity
from .analysis import severity_label
from .family_tensor import TENSOR
from .metrics import from_sums
from .scales import Scales
from .sweep_levels import (
    ELEMENT_FORMATS,
    Alignment,
    ElementGrid,
    LevelPlan,
    PreparedTensor,
    SweepInputError,
    alignment_exponents,
    cast_elements,
    cast_levels,
    element_grid,
    get_element_grid,
    min_nonzero_abs,
    plan_levels,
    prepare_tensor,
    scale_exponent_limits,
    scale_factors,
)

__all__ = ["ELEMENT_FORMATS", "Alignment", "ElementGrid", "LevelPlan", "PreparedTensor",
           "SweepInputError", "alignment_exponents", "cast_elements", "cast_levels",
           "element_grid", "get_element_grid", "min_nonzero_abs", "plan_levels",
           "prepare_tensor", "scale_exponent_limits", "scale_factors", "run_sweep",
           "SweepResult", "LevelResult", "accumulate_stats", "composite_scores",
           "stability_analysis", "overflow_summary", "severity", "single_intraop_thread"]

#: composite-score weights (MSE 30 %, cosine 30 %, PSNR 20 %, MAE 10 %, rel. 10 %: the weights
#: the first sweep tool ranked by, kept so its users' recommendations do not move)
COMPOSITE_WEIGHTS = {"mse": 0.30, "cosine_similarity": 0.30, "psnr": 0.20, "mae": 0.10, "relative_error": 0.10}
#: metrics where lower is better; the others (cosine, psnr) are higher-is-better
LOWER_IS_BETTER = frozenset({"mse", "rmse", "mae", "max_abs_error", "relative_error"})
#: metrics normalized in log10 space for the composite (errors span decades)
LOG_NORMALIZED = frozenset({"mse", "mae", "relative_error"})

#: the levels' severities are quant.analysis' names as reports print them
SEVERITY_NONE, SEVERITY_HIGH = sweep_verdicts.NONE, sweep_verdicts.HIGH

#: elements per [levels, chunk] tile in the batched pass (512 KiB of float32: stays in cache)
DEFAULT_CHUNK = 1 << 17

METRIC_NAMES = ("mse", "rmse", "cosine_similarity", "psnr", "mae", "max_abs_error", "relative_error")


# --------------------------------------------------------------------------------------
# the batched sweep


@dataclass
class LevelStats:
    """Per-level sums accumulated over chunks (float64)."""

    n: int
    sum_x2: float
    sum_absx: float
    sum_q2: torch.Tensor
    sum_xq: torch.Tensor
    sse: torch.Tensor
    sae: torch.Tensor
    max_err: torch.Tensor
    overflow: torch.Tensor
    underflow: torch.Tensor
    flush_to_zero: torch.Tensor
    amax: float
    xmin: float
    xmax: float
    zeros: int


def _below_step(c: float) -> float:
    """Smallest positive gap between float32 ``c`` and any float32 below it."""
    c32 = torch.tensor(c, dtype=torch.float32)
    return float(c32 - torch.nextafter(c32, torch.tensor(0.0)))


def accumulate_stats(values: torch.Tensor, factors: torch.Tensor, grid: ElementGrid, *,
                     chunk: int | None = None, workers: int | None = None,
                     progress: Callable[[int], None] | None = None) -> LevelStats:
    """One pass over ``values`` computing every level's sums at once.

    Works on magnitudes: the cast is symmetric, so ``|x - q| = ||x| - |q||`` and
    ``x * q = |x| * |q|``. Per chunk, for all levels at once (a ``[L, chunk]`` tile that
    stays in cache): ``v = |x| / f``; underflow ``x != 0`` and ``v < min_normal``; the cast
    without saturation, overflow where it rounds above max_normal, saturation; flush to zero
    ``x != 0`` with cast 0 (``quant.analyze_quantization``'s definitions); ``q * f`` and the
    error sums. Counts use exact float arithmetic instead of boolean masks (several times
    faster on CPU): ``clamp(v - t, -gap, 0)`` is 0 or exactly ``-gap`` (``gap`` = the float32
    or grid spacing at the threshold ``t``), so its sum divided by ``gap`` is the count.

    Parallelism: ``workers`` Python threads (default: torch's thread count) each take a
    contiguous part, with torch's intra-op threads set to 1 meanwhile (restored after).
    Small tiles split across intra-op threads spend their time in barriers, which on a busy
    machine made the sweep 5-20x slower.
    """
    L = int(factors.numel())
    f = TENSOR.levels(factors)          # x / f, cast, times f: one scale per level (row)
    n = int(values.numel())
    if chunk is None:
        chunk = DEFAULT_CHUNK // max(L, 1)
    chunk = max(256, min(chunk, max(n, 1), grid.max_exact_chunk))
    workers = max(1, workers or torch.get_num_threads())
    per = -(-n // workers) if n else 0
    per = -(-per // chunk) * chunk if per else 0       # whole chunks per worker
    parts = [values[s:s + per] for s in range(0, n, per)] if n else []
    with single_intraop_thread():
        if len(parts) <= 1:
            partials = [_accumulate_part(p, f, grid, chunk, progress) for p in parts]
        else:
            with ThreadPoolExecutor(len(parts)) as pool:
                partials = list(pool.map(
                    lambda p: _accumulate_part(p, f, grid, chunk, progress), parts))
    zero = torch.zeros(L, dtype=torch.float64)
    tot = {k: sum((pt[k] for pt in partials), zero.clone())
           for k in ("sum_q2", "sum_xq", "sse", "sae", "over", "under", "nonzero_q")}
    max_err = zero.clone()
    for pt in partials:
        torch.maximum(max_err, pt["max_err"], out=max_err)
    zeros = int(sum(pt["zeros"] for pt in partials))
    sum_x2 = float(sum(pt["sum_x2"] for pt in partials))
    sum_absx = float(sum(pt["sum_absx"] for pt in partials))
    xmin = float(values.amin()) if n else 0.0
    xmax = float(values.amax()) if n else 0.0
    amax = max(-xmin, xmax)
    return LevelStats(n, sum_x2, sum_absx, tot["sum_q2"], tot["sum_xq"], tot["sse"], tot["sae"],
                      max_err, tot["over"].round(), (tot["under"] - zeros).round(),
                      (n - zeros - tot["nonzero_q"]).round(), amax, xmin, xmax, zeros)


def _accumulate_part(values: torch.Tensor, f: Scales, grid: ElementGrid, chunk: int,
                     progress: Callable[[int], None] | None) -> dict[str, torch.Tensor]:
    """The per-level partial sums of one contiguous part (see ``accumulate_stats``)."""
    L = int(f.encode.shape[0])
    n = int(values.numel())
    chunk = min(chunk, n)
    v = torch.empty(L, chunk)
    t = torch.empty(L, chunk)
    z = lambda: torch.zeros(L, dtype=torch.float64)  # noqa: E731
    out = {k: z() for k in ("sum_q2", "sum_xq", "sse", "sae", "over", "under", "nonzero_q")}
    max_err = torch.zeros(L, dtype=torch.float32)
    gap_over = grid.top_step
    gap_under = _below_step(grid.min_normal)
    zeros, sum_x2, sum_absx = 0, 0.0, 0.0
    for start in range(0, n, chunk):
        ax = values[start:start + chunk].abs()
        m = int(ax.numel())
        vv, tt = v[:, :m], t[:, :m]
        torch.div(ax[None, :], f.encode, out=vv)
        torch.sub(vv, grid.min_normal, out=tt).clamp_(-gap_under, 0.0)
        out["under"] -= tt.sum(1).double() / gap_under
        vv.clamp_(max=grid.overflow_cap)
        grid.round_(vv)                              # q (magnitudes), not yet saturated
        # each element becomes max_normal or max_normal + gap: the row sum is exact (see
        # ElementGrid.max_exact_chunk) and its excess over m * max_normal counts overflow
        torch.clamp(vv, min=grid.max_normal, max=grid.max_normal + gap_over, out=tt)
        out["over"] += (tt.sum(1).double() - m * grid.max_normal) / gap_over
        vv.clamp_(max=grid.max_normal)               # saturate
        torch.clamp(vv, max=grid.min_subnormal, out=tt)
        out["nonzero_q"] += tt.sum(1).double() / grid.min_subnormal
        vv.mul_(f.decode)                            # dequantized magnitudes
        out["sum_xq"] += (vv @ ax).double()
        out["sum_q2"] += torch.linalg.vecdot(vv, vv).double()
        sum_x2 += float(torch.dot(ax, ax))
        sum_absx += float(ax.sum())
        zeros += m - int(torch.count_nonzero(ax))
        vv.sub_(ax)                                  # error (sign flipped: irrelevant)
        out["sse"] += torch.linalg.vecdot(vv, vv).double()
        vv.abs_()
        out["sae"] += vv.sum(1).double()
        torch.maximum(max_err, torch.amax(vv, dim=1), out=max_err)
        if progress is not None:
            progress(m)
    out["max_err"] = max_err.double()
    out.update(zeros=zeros, sum_x2=sum_x2, sum_absx=sum_absx)
    return out


# --------------------------------------------------------------------------------------
# per-level results


@dataclass
class LevelResult:
    """Everything the reports say about one scale exponent. The ratios divide the counts by
    the finite elements swept; the severities are quant.analysis' of those ratios."""

    scale_exp: float
    scale_factor: float
    metrics: dict[str, float]
    overflow_count: int
    underflow_count: int
    flush_to_zero_count: int
    elements: int                            # finite elements swept (at least 1)
    scaled_range: tuple[float, float]       # of x / f, before the cast
    quantized_range: tuple[float, float]    # of the cast values (before multiplying back)
    mx_scale: bool                           # integer exponent: representable as an E8M0 scale

    @property
    def overflow_ratio(self) -> float:
        return self.overflow_count / self.elements

    @property
    def underflow_ratio(self) -> float:
        return self.underflow_count / self.elements

    @property
    def flush_to_zero_ratio(self) -> float:
        return self.flush_to_zero_count / self.elements

    @property
    def overflow_severity(self) -> str:
        return severity(self.overflow_ratio)

    @property
    def underflow_severity(self) -> str:
        return severity(self.underflow_ratio)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, the counts followed by their ratios and severities."""
        counts = {k: getattr(self, k) for k in _LEVEL_COUNT_KEYS}
        return {"scale_exp": self.scale_exp, "scale_factor": self.scale_factor,
                "metrics": dict(self.metrics), **counts,
                "scaled_range": list(self.scaled_range),
                "quantized_range": list(self.quantized_range), "mx_scale": self.mx_scale}


#: LevelResult.to_dict's keys between the metrics and the ranges, in order
_LEVEL_COUNT_KEYS = ("overflow_count", "underflow_count", "flush_to_zero_count",
                     "overflow_ratio", "underflow_ratio", "flush_to_zero_ratio",
                     "overflow_severity", "underflow_severity")


def severity(ratio: float) -> str:
    """``quant.analysis.severity`` (HIGH above 1 %, MEDIUM above 0.1 %, else NONE), as the
    original sweep script's report prints it (``quant.analysis.severity_label``)."""
    return severity_label(_severity(ratio))


def metrics_from_stats(st: LevelStats) -> dict[str, torch.Tensor]:
    """Metric values per level from the accumulated sums (``quant.metrics.from_sums``: the
    definitions of ``quant.metrics``; ``tests/test_scaling_sweep.py`` checks every level
    against ``quant.metrics`` on the materialized tensors)."""
    return from_sums(st.n, st.sum_x2, st.sum_absx, st.amax, sum_q2=st.sum_q2, sum_xq=st.sum_xq,
                     sse=st.sse, sae=st.sae, max_err=st.max_err)


# --------------------------------------------------------------------------------------
# analyses


def composite_scores(metrics: dict[str, Sequence[float]],
                     weights: dict[str, float] = COMPOSITE_WEIGHTS) -> list[float]:
    """Weighted sum of per-metric scores in [0, 1] (1 = best level for that metric).

    Normalization, per metric across the swept levels: min-max, ``(worst - v) / (worst -
    best)`` for lower-is-better metrics and ``(v - worst) / (best - worst)`` for cosine and
    PSNR. MSE, MAE and relative error are normalized on log10 of their values (they span
    decades; a linear scale would let one saturating level flatten all the others); cosine
    and PSNR (already logarithmic) linearly. An exact level (error 0, PSNR +inf) scores 1;
    an undefined value (NaN) scores 0; if all levels tie, all score 1.
    """
    n = len(next(iter(metrics.values())))
    total = [0.0] * n
    for name, w in weights.items():
        for i, sc in enumerate(_metric_scores(name, [float(v) for v in metrics[name]])):
            total[i] += w * sc
    return total


def _metric_scores(name: str, vals: list[float]) -> list[float]:
    lower = name in LOWER_IS_BETTER
    if name in LOG_NORMALIZED:
        vals = [(-math.inf if v == 0 else math.log10(v)) if v >= 0 else math.nan for v in vals]
    exact = -math.inf if lower else math.inf
    finite = [v for v in vals if math.isfinite(v)]
    best = (min(finite) if lower else max(finite)) if finite else 0.0
    worst = (max(finite) if lower else min(finite)) if finite else 0.0
    out = []
    for v in vals:
        if v == exact:
            out.append(1.0)
        elif not math.isfinite(v):
            out.append(0.0)
        elif best == worst:
            out.append(1.0)
        else:
            out.append((worst - v) / (worst - best) if lower else (v - worst) / (best - worst))
    return out


def _best_index(vals: Sequence[float], lower: bool) -> int | None:
    """Index of the best value (NaN never wins; ties go to the last, i.e. the larger
    exponent: the overflow-safe side, as in ``recommend``)."""
    idx = [i for i, v in enumerate(vals) if not math.isnan(v)]
    if not idx:
        return None
    sign = -1.0 if lower else 1.0
    return max(idx, key=lambda i: (sign * vals[i], i))


def stability_analysis(metrics: dict[str, Sequence[float]]) -> dict[str, Any]:
    """Ranges, deltas, max/min ratios and standard deviations (population) of the key metrics
    over the levels, with ``n`` the number of finite values (non-finite ones are left out;
    None when there is none). The words about them come from ``sweep_verdicts.RULES``."""
    out: dict[str, Any] = {}
    for name in ("mse", "cosine_similarity", "psnr", "mae", "relative_error"):
        vals = [float(v) for v in metrics[name] if math.isfinite(float(v))]
        if not vals:
            out[name] = None
            continue
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        lo, hi = min(vals), max(vals)
        ratio = hi / lo if lo > 0 else (math.inf if hi > 0 else 1.0)
        out[name] = {"min": lo, "max": hi, "delta": hi - lo, "std": std, "ratio": ratio,
                     "n": len(vals)}
    return out


def overflow_summary(levels: Sequence[LevelResult]) -> dict[str, Any]:
    """Which levels overflow/underflow significantly, the extremes, and the least bad level."""
    sig = [lv for lv in levels
           if lv.overflow_severity != SEVERITY_NONE or lv.underflow_severity != SEVERITY_NONE]
    over = [lv for lv in levels if lv.overflow_severity != SEVERITY_NONE]
    under = [lv for lv in levels if lv.underflow_severity != SEVERITY_NONE]
    clean = [lv for lv in levels if lv not in sig]
    by_over = sorted(levels, key=lambda lv: (lv.overflow_ratio, -lv.scale_exp))
    by_under = sorted(levels, key=lambda lv: (lv.underflow_ratio, lv.flush_to_zero_ratio))
    least = min(levels, key=lambda lv: (lv.overflow_ratio + lv.underflow_ratio,
                                        lv.overflow_ratio)) if levels else None
    return {
        "significant": sig, "overflow_levels": over, "underflow_levels": under,
        "clean_levels": clean,
        "worst_overflow": by_over[-1] if levels else None,
        "best_overflow": by_over[0] if levels else None,
        "worst_underflow": by_under[-1] if levels else None,
        "best_underflow": by_under[0] if levels else None,
        "least_problematic": least,
        "any_high": any(SEVERITY_HIGH in (lv.overflow_severity, lv.underflow_severity)
                        for lv in levels),
    }


@dataclass
class Recommendation:
    index: int
    scale_exp: float
    scale_factor: float
    composite_score: float
    position: float            # 0 = smallest exponent of the sweep, 1 = largest


def best_by_metric(levels: Sequence[LevelResult]) -> dict[str, int]:
    """Index of the best level per metric (NaN never wins; ties: the larger exponent)."""
    best = {k: _best_index([lv.metrics[k] for lv in levels], k in LOWER_IS_BETTER)
            for k in METRIC_NAMES}
    return {k: v for k, v in best.items() if v is not None}


def composite_best(levels: Sequence[LevelResult], scores: Sequence[float]) -> int:
    """Index of the composite-best level (ties: the larger exponent, the overflow-safe side)."""
    return max(range(len(levels)), key=lambda i: (round(scores[i], 12), levels[i].scale_exp))


def recommend(levels: Sequence[LevelResult], scores: Sequence[float],
              min_exp: float, max_exp: float) -> Recommendation:
    """The composite-best level as a Recommendation (whether to make one at all is
    ``sweep_verdicts``' call: see ``run_sweep``)."""
    idx = composite_best(levels, scores)
    lv = levels[idx]
    pos = 0.5 if max_exp == min_exp else (lv.scale_exp - min_exp) / (max_exp - min_exp)
    return Recommendation(idx, lv.scale_exp, lv.scale_factor, scores[idx], pos)


# --------------------------------------------------------------------------------------
# the whole sweep


@dataclass
class SweepResult:
    """A finished sweep: inputs, per-level results and the analyses."""

    format_name: str
    grid: ElementGrid
    tensor: dict[str, Any]
    plan: LevelPlan
    levels: list[LevelResult]
    scores: list[float]
    stability: dict[str, Any]
    overflow: dict[str, Any]
    recommendation: Recommendation | None      # None: the verdicts say why not
    scale_bits: int
    best_by_metric: dict[str, int] = field(default_factory=dict)
    #: topic -> [sweep_verdicts.Verdict] (stability, recommendation, position, range, advice,
    #: plot_note)
    verdicts: dict[str, list] = field(default_factory=dict)

    def says(self, topic: str) -> list[str]:
        """The phrases of one verdict topic (empty when none applies)."""
        return [v.text for v in self.verdicts.get(topic, []) if v.text]

    def metric(self, name: str) -> list[float]:
        return [lv.metrics[name] for lv in self.levels]

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (lists, dicts, floats: inf/nan stay floats; writers make them
        JSON-safe, e.g. ``lowp_common.json_safe``)."""
        rec = self.recommendation
        ov = self.overflow
        ref = lambda lv: None if lv is None else lv.scale_exp  # noqa: E731
        return {
            "format": self.format_name,
            "element": {"max_normal": self.grid.max_normal, "min_normal": self.grid.min_normal,
                        "min_subnormal": self.grid.min_subnormal},
            "scale_bits": self.scale_bits,
            "tensor": self.tensor,
            "max_alignment_exp": self.plan.alignment.max_align,
            "min_alignment_exp": self.plan.alignment.min_align,
            "max_scale_exp": self.plan.max_exp, "min_scale_exp": self.plan.min_exp,
            "notes": self.plan.notes,
            "levels": [dict(lv.to_dict(), composite_score=s)
                       for lv, s in zip(self.levels, self.scores)],
            "best_by_metric": {k: self.levels[i].scale_exp
                               for k, i in self.best_by_metric.items()},
            "recommendation": None if rec is None else {
                "scale_exp": rec.scale_exp, "scale_factor": rec.scale_factor,
                "composite_score": rec.composite_score, "position": rec.position,
                "note": " ".join(self.says("position"))},
            "no_recommendation": None if rec is not None else " ".join(
                self.says("recommendation")),
            "stability": {k: v for k, v in self.stability.items()},
            "verdicts": {t: [{"rule": v.rule, "text": v.text} for v in vs]
                         for t, vs in self.verdicts.items()},
            "overflow_summary": {
                "significant_levels": [lv.scale_exp for lv in ov["significant"]],
                "clean_levels": [lv.scale_exp for lv in ov["clean_levels"]],
                "worst_overflow": ref(ov["worst_overflow"]),
                "worst_underflow": ref(ov["worst_underflow"]),
                "best_underflow": ref(ov["best_underflow"]),
                "least_problematic": ref(ov["least_problematic"]),
            },
        }


def run_sweep(tensor: Any, elem_format: str = "fp8_e4m3", *, num_levels: int = 21,
              max_scale_exp: float | None = None, min_scale_exp: float | None = None,
              scale_bits: int = 8, chunk: int | None = None, workers: int | None = None,
              source: str = "input",
              progress: Callable[[int], None] | None = None) -> SweepResult:
    """Sweep ``num_levels`` scale exponents over ``tensor`` and analyze the results."""
    grid = get_element_grid(elem_format)
    workers = max(1, workers or torch.get_num_threads())
    with single_intraop_thread():
        return _run_sweep(tensor, grid, elem_format, num_levels, max_scale_exp, min_scale_exp,
                          scale_bits, chunk, workers, source, progress)


@contextmanager
def single_intraop_thread():
    """torch intra-op threads set to 1 for the block, restored after (see accumulate_stats:
    the sweep parallelizes over chunks with its own threads instead)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _run_sweep(tensor, grid, elem_format, num_levels, max_scale_exp, min_scale_exp, scale_bits,
               chunk, workers, source, progress) -> SweepResult:
    prep = prepare_tensor(tensor, source)
    try:
        plan = plan_levels(prep.values, grid, num_levels=num_levels,
                           max_scale_exp=max_scale_exp, min_scale_exp=min_scale_exp,
                           scale_bits=scale_bits)
    except SweepInputError as exc:
        raise SweepInputError(f"{source}: {exc}") from None
    factors = scale_factors(plan.levels)
    st = accumulate_stats(prep.values, factors, grid, chunk=chunk, workers=workers,
                          progress=progress)
    mets = {k: v.tolist() for k, v in metrics_from_stats(st).items()}
    n = max(st.n, 1)
    lo_lim, hi_lim = scale_exponent_limits(scale_bits)
    ends = torch.tensor([st.xmin, st.xmax], dtype=torch.float32)
    levels: list[LevelResult] = []
    for i, s in enumerate(plan.levels):
        f = factors[i:i + 1]
        scaled = ends / f
        quantized = cast_elements(scaled, grid)
        o, u, z = int(st.overflow[i]), int(st.underflow[i]), int(st.flush_to_zero[i])
        levels.append(LevelResult(
            float(s), float(factors[i]), {k: float(mets[k][i]) for k in METRIC_NAMES},
            o, u, z, n,
            (float(scaled[0]), float(scaled[1])), (float(quantized[0]), float(quantized[1])),
            float(s).is_integer() and lo_lim <= s <= hi_lim))
    scores = composite_scores(mets)
    info = {"shape": list(prep.shape), "dtype": prep.dtype, "numel": prep.numel,
            "finite": prep.finite_count, "nan": prep.nan_count, "inf": prep.inf_count,
            "zeros": st.zeros, "min": st.xmin, "max": st.xmax, "amax": st.amax,
            "min_nonzero_abs": plan.alignment.amin_nonzero}
    stability = stability_analysis(mets)
    chosen, verdicts = sweep_verdicts.decide(levels, scores, stability, st.zeros == st.n,
                                             plan.sparse_reason, composite_best(levels, scores))
    rec = None if chosen is None else recommend(levels, scores, plan.min_exp, plan.max_exp)
    return SweepResult(elem_format, grid, info, plan, levels, scores, stability,
                       overflow_summary(levels), rec, scale_bits,
                       best_by_metric(levels) if rec is not None else {}, verdicts)
