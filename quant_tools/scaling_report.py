"""Text reports of an MXFP scale sweep: the console / log lines and the results file.

The sweep's numbers and its analyses come from ``quant.scaling_sweep``, every verdict phrase
(stability, recommendation, its position, the range, the advice) from the rule table of
``quant.sweep_verdicts`` through ``SweepResult.says``; this module only lays them out as text
(the log and the ``mxfp_scaling_results_<format>.txt`` file say the same).
"""
from __future__ import annotations

import math

from quant.scaling_sweep import SEVERITY_NONE, LevelResult, SweepResult, scale_exponent_limits

RULE = "=" * 80
SUBRULE = "-" * 80
SHORT = "-" * 40


def fmt_factor(f: float) -> str:
    """The original sweep script printed factors with 6 decimals; tiny or huge ones need an exponent."""
    return f"{f:.6f}" if 1e-4 <= abs(f) < 1e7 else f"{f:.6e}"


def format_tensor_info(res: SweepResult) -> list[str]:
    t = res.tensor
    lines = [f"Tensor shape: {tuple(t['shape'])}, dtype: {t['dtype']}, elements: {t['numel']}",
             f"Value range: [{t['min']:.6e}, {t['max']:.6e}], max |x|: {t['amax']:.6e}, "
             f"min non-zero |x|: "
             + ("none" if t["min_nonzero_abs"] is None else f"{t['min_nonzero_abs']:.6e}"),
             f"Zeros: {t['zeros']}"]
    if t["nan"] or t["inf"]:
        lines.append(f"⚠️  Excluded non-finite values: {t['nan']} NaN, {t['inf']} Inf "
                     f"({(t['nan'] + t['inf']) / t['numel'] * 100:.4f}% of elements); "
                     f"metrics use the {t['finite']} finite values")
    return lines


def format_parameters(res: SweepResult) -> list[str]:
    p, g = res.plan, res.grid
    al = p.alignment
    lines = [f"Format: {res.format_name} ({g.layout}; max normal {g.max_normal:.6g}, min normal "
             f"{g.min_normal:.6g}, min subnormal {g.min_subnormal:.6g})",
             f"Scale bits: {res.scale_bits} (E{res.scale_bits}M0 exponents "
             f"{list(scale_exponent_limits(res.scale_bits))})",
             "Max alignment exponent floor(log2(amax/max_normal)): "
             + ("undefined" if al.max_align is None else str(al.max_align)),
             "Min alignment exponent ceil(log2(min_nonzero/min_normal)): "
             + ("undefined" if al.min_align is None else str(al.min_align)),
             f"Scale exponent range: {p.min_exp:.2f} to {p.max_exp:.2f}, {len(p.levels)} levels"]
    lines += [f"Note: {n}" for n in p.notes]
    return lines


def format_level_line(i: int, lv: LevelResult, total: int) -> str:
    m = lv.metrics
    return (f"Level {i + 1}/{total}: Scale Exp {lv.scale_exp:.2f} (Factor "
            f"{fmt_factor(lv.scale_factor)}) MSE {m['mse']:.6e}, Cosine {m['cosine_similarity']:.6f}, "
            f"PSNR {m['psnr']:.2f} dB, MAE {m['mae']:.6e}, MaxErr {m['max_abs_error']:.6e}, "
            f"RelErr {m['relative_error'] * 100:.2f}% | overflow {lv.overflow_ratio * 100:.2f}%, "
            f"underflow {lv.underflow_ratio * 100:.2f}%, flushed {lv.flush_to_zero_ratio * 100:.2f}%")


def _metric_trio(lv: LevelResult) -> str:
    m = lv.metrics
    return f"MSE: {m['mse']:.6e}, Cosine: {m['cosine_similarity']:.6f}, PSNR: {m['psnr']:.2f} dB"


OPTIMA_LINES = (("mse", "🏆 Best MSE"), ("cosine_similarity", "🎯 Best Cosine Similarity"),
                ("psnr", "📊 Best PSNR"), ("mae", "📉 Best MAE"),
                ("relative_error", "📐 Best Relative Error"))


def format_analysis(res: SweepResult) -> list[str]:
    """SCALING FACTOR ANALYSIS & RECOMMENDATIONS (the sections and order users of the first sweep tool know). Without a
    recommendation (one level, all zeros, every level alike) the sections that would compare
    levels say why instead."""
    rec, lv_all, st = res.recommendation, res.levels, res.stability
    p = res.plan
    out = [RULE, "SCALING FACTOR ANALYSIS & RECOMMENDATIONS", RULE,
           f"Format: {res.format_name} ({res.grid.layout})",
           (f"Tested {len(lv_all)} scaling levels from {p.min_exp:.2f} to {p.max_exp:.2f}"
            if len(lv_all) > 1 else f"Tested 1 scaling level at {p.max_exp:.2f}"),
           SUBRULE, "INDIVIDUAL METRIC OPTIMA:", SHORT]
    no_rec = res.says("recommendation") if rec is None else []
    if rec is None:
        out += no_rec
    for key, label in OPTIMA_LINES if rec is not None else ():
        i = res.best_by_metric.get(key)
        if i is None:
            out.append(f"{label}: undefined at every level")
            continue
        lv = lv_all[i]
        out += [f"{label}: Scale Exp = {lv.scale_exp:.2f}, Factor = {fmt_factor(lv.scale_factor)}",
                f"    {_metric_trio(lv)}"]
    out += [SUBRULE, "COMPOSITE RECOMMENDATION:", SHORT]
    if rec is None:
        out += no_rec
    else:
        lv = lv_all[rec.index]
        m = lv.metrics
        out += [f"⭐ RECOMMENDED Scaling Factor: {fmt_factor(lv.scale_factor)}",
                f"   Scale Exponent: {lv.scale_exp:.2f}",
                f"   Composite Score: {rec.composite_score:.4f} (MSE 30%, cosine 30%, PSNR 20%, "
                "MAE 10%, relative error 10%; each min-max normalized over the levels)",
                "   Balanced Performance:",
                f"     - MSE: {m['mse']:.6e}", f"     - Cosine Similarity: {m['cosine_similarity']:.6f}",
                f"     - PSNR: {m['psnr']:.2f} dB", f"     - MAE: {m['mae']:.6e}",
                f"     - Relative Error: {m['relative_error'] * 100:.2f}%"]
    out += [SUBRULE, "PERFORMANCE ANALYSIS:", SHORT]
    for key, label, fmt, unit in (("mse", "MSE", ".6e", ""), ("cosine_similarity", "Cosine", ".6f", ""),
                                  ("psnr", "PSNR", ".2f", " dB")):
        s = st.get(key)
        if s is None:
            out.append(f"{label} Range: no finite values")
            continue
        out.append(f"{label} Range: {s['min']:{fmt}} to {s['max']:{fmt}}{unit} "
                   f"(Δ: {s['delta']:{fmt}}{unit})")
    for key, label, fmt in (("mse", "MSE", ".6e"), ("cosine_similarity", "Cosine", ".6f")):
        s = st.get(key)
        if s is not None:
            out.append(f"{label} Stability (std): {s['std']:{fmt}}")
    out += [SUBRULE, "RECOMMENDATIONS:", SHORT]
    out += res.says("mse") + res.says("cosine") + res.says("psnr")
    out += [SUBRULE, "FINAL RECOMMENDATION:", SHORT]
    if rec is None:
        out += no_rec
    else:
        lv = lv_all[rec.index]
        out += [f"🎯 Use scaling factor: {fmt_factor(lv.scale_factor)}",
                f"   The best composite score of the {len(lv_all)} levels for "
                f"{res.format_name} quantization",
                f"   Scale exponent: {lv.scale_exp:.2f}"
                + ("" if lv.mx_scale else " (not an integer: no E8M0 scale encodes it; nearest "
                   f"MX scales are 2^{math.floor(lv.scale_exp)} and 2^{math.ceil(lv.scale_exp)})")]
        out += [f"   {t}" for t in res.says("position")]
        if lv.overflow_severity != SEVERITY_NONE or lv.underflow_severity != SEVERITY_NONE:
            out.append(f"   ⚠️  At this level: overflow {lv.overflow_ratio * 100:.2f}% "
                       f"({lv.overflow_severity}), underflow {lv.underflow_ratio * 100:.2f}% "
                       f"({lv.underflow_severity})")
    out.append(RULE)
    return out


def format_overflow_summary(res: SweepResult) -> list[str]:
    """OVERFLOW/UNDERFLOW ANALYSIS SUMMARY (issues per level, extremes, recommendations)."""
    ov, g = res.overflow, res.grid
    rng = lambda lv: f"[{lv.scaled_range[0]:.2e}, {lv.scaled_range[1]:.2e}]"  # noqa: E731
    qrng = lambda lv: f"[{lv.quantized_range[0]:.2e}, {lv.quantized_range[1]:.2e}]"  # noqa: E731
    out = [RULE, "OVERFLOW/UNDERFLOW ANALYSIS SUMMARY", RULE, f"Format: {res.format_name}",
           f"Analyzed {len(res.levels)} scaling levels",
           f"Significant overflow/underflow detected in {len(ov['significant'])} levels", SUBRULE]
    if ov["overflow_levels"]:
        out += ["🔴 OVERFLOW ISSUES:", SHORT]
        for lv in ov["overflow_levels"]:
            out += [f"  Scale Exp: {lv.scale_exp:.2f} (Factor: {fmt_factor(lv.scale_factor)})",
                    f"    Overflow: {lv.overflow_count} ({lv.overflow_ratio * 100:.2f}%)",
                    f"    Max Normal: {g.max_normal:.2e}",
                    f"    Tensor Range: {rng(lv)} (after quantization {qrng(lv)})",
                    f"    Severity: {lv.overflow_severity}"]
        out.append("")
    if ov["underflow_levels"]:
        out += ["🟡 UNDERFLOW ISSUES:", SHORT]
        for lv in ov["underflow_levels"]:
            out += [f"  Scale Exp: {lv.scale_exp:.2f} (Factor: {fmt_factor(lv.scale_factor)})",
                    f"    Underflow: {lv.underflow_count} ({lv.underflow_ratio * 100:.2f}%)",
                    f"    Flush to Zero: {lv.flush_to_zero_count} "
                    f"({lv.flush_to_zero_ratio * 100:.2f}%)",
                    f"    Min Normal: {g.min_normal:.2e}",
                    f"    Tensor Range: {rng(lv)} (after quantization {qrng(lv)})",
                    f"    Severity: {lv.underflow_severity}"]
        out.append("")
    wo, bo = ov["worst_overflow"], ov["best_overflow"]
    out += ["OVERFLOW EXTREMES:", SHORT]
    if res.says("extremes"):
        out += res.says("extremes")
    elif wo is None or wo.overflow_count == 0:
        out.append("No overflow at any level")
    else:
        out += [f"Worst Overflow: Scale Exp {wo.scale_exp:.2f}",
                f"  {wo.overflow_ratio * 100:.2f}% overflow",
                f"Best Overflow: Scale Exp {bo.scale_exp:.2f}",
                f"  {bo.overflow_ratio * 100:.2f}% overflow"]
    wu, bu = ov["worst_underflow"], ov["best_underflow"]
    out += ["", "UNDERFLOW EXTREMES:", SHORT]
    if res.says("extremes"):
        out += res.says("extremes")
    elif wu is None or wu.underflow_count == 0:
        out.append("No underflow at any level")
    else:
        out += [f"Worst Underflow: Scale Exp {wu.scale_exp:.2f}",
                f"  {wu.underflow_ratio * 100:.2f}% underflow, "
                f"{wu.flush_to_zero_ratio * 100:.2f}% flushed to zero",
                f"Best Underflow: Scale Exp {bu.scale_exp:.2f}",
                f"  {bu.underflow_ratio * 100:.2f}% underflow, "
                f"{bu.flush_to_zero_ratio * 100:.2f}% flushed to zero"]
    out += [SUBRULE, "OVERFLOW/UNDERFLOW RECOMMENDATIONS:", SHORT]
    out += res.says("advice") + res.says("range")
    out.append(RULE)
    return out


TABLE_COLUMNS = (("scale_exp", "ScaleExp", "{:>9.3f}"), ("scale_factor", "Factor", "{:>14.6e}"),
                 ("mse", "MSE", "{:>13.6e}"), ("rmse", "RMSE", "{:>13.6e}"),
                 ("cosine_similarity", "Cosine", "{:>10.6f}"), ("psnr", "PSNR_dB", "{:>9.2f}"),
                 ("mae", "MAE", "{:>13.6e}"), ("max_abs_error", "MaxAbsErr", "{:>13.6e}"),
                 ("relative_error", "RelErr_%", "{:>9.3f}"),
                 ("overflow_ratio", "Overflow_%", "{:>10.4f}"),
                 ("underflow_ratio", "Underflow_%", "{:>11.4f}"),
                 ("flush_to_zero_ratio", "FlushZero_%", "{:>11.4f}"),
                 ("composite", "Composite", "{:>9.4f}"))


def results_table(res: SweepResult) -> list[str]:
    """One row per level: every metric, the overflow/underflow ratios and the score."""
    widths = [len(fmt.format(0.0)) for _, _, fmt in TABLE_COLUMNS]
    head = " ".join(f"{h:>{w}}" for (_, h, _), w in zip(TABLE_COLUMNS, widths))
    rows = [head, "-" * len(head)]
    for lv, sc in zip(res.levels, res.scores):
        vals = dict(lv.metrics, relative_error=lv.metrics["relative_error"] * 100,
                    scale_exp=lv.scale_exp, scale_factor=lv.scale_factor,
                    overflow_ratio=lv.overflow_ratio * 100, underflow_ratio=lv.underflow_ratio * 100,
                    flush_to_zero_ratio=lv.flush_to_zero_ratio * 100, composite=sc)
        rows.append(" ".join(fmt.format(vals[k]) for k, _, fmt in TABLE_COLUMNS))
    return rows


def results_text(res: SweepResult, source: str = "") -> str:
    """The whole ``mxfp_scaling_results_<format>.txt``."""
    lines = [RULE, f"MXFP SCALING TEST RESULTS: {res.format_name}", RULE]
    if source:
        lines.append(f"Input: {source}")
    lines += format_tensor_info(res) + format_parameters(res)
    lines += ["How a level is applied: x / 2^s is cast to the element format (round to nearest "
              "even, saturating), then multiplied by 2^s; ratios are of finite elements.", ""]
    lines += results_table(res) + [""] + format_analysis(res) + [""] + format_overflow_summary(res)
    return "\n".join(lines) + "\n"
