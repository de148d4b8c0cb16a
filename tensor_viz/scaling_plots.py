"""Figures of an MXFP scale sweep (``quant.scaling_sweep.SweepResult``).

Two figures per tensor and format: ``mxfp_scaling_test_<format>.png`` (six panels: every
metric and the overflow/underflow ratios against the scale exponent) and
``mxfp_scaling_summary_<format>.png`` (MSE, cosine, PSNR and the composite score, with the
recommendation). Matplotlib Agg only; files are written under a temp name, then renamed.
A sweep with too few levels for a curve (``quant.sweep_verdicts``' ``plot_note``) says why in a
caption and on every panel; without a recommendation (one level, all zeros, every level alike)
no level is marked and the summary box gives the reason instead.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from lowp_common import atomic_path

X_LABEL = "scale exponent s (tensor divided by 2^s)"

#: panel table of the six-panel figure: (title, [(metric key, legend, color)], y label, kind)
#: kind: "auto" = log scale when the positive values span more than a decade
PANELS = (
    ("Mean squared error", [("mse", "MSE", "tab:blue"), ("rmse", "RMSE", "tab:cyan")],
     "error (value², RMSE: value units)", "auto"),
    ("Cosine similarity", [("cosine_similarity", "cosine", "tab:green")], "cosine similarity (1 = same "
                                                                "direction)", "linear"),
    ("PSNR", [("psnr", "PSNR", "tab:purple")], "PSNR (dB, peak = max |x|)", "linear"),
    ("Absolute error", [("mae", "MAE", "tab:orange"), ("max_abs_error", "max |error|", "tab:red")],
     "absolute error (value units)", "auto"),
    ("Relative error", [("relative_error_pct", "||x - q||₁ / ||x||₁", "tab:brown")],
     "relative error (%)", "auto"),
    ("Overflow / underflow", [("overflow_pct", "overflow", "tab:red"),
                              ("underflow_pct", "underflow", "tab:olive"),
                              ("flush_pct", "flushed to zero", "tab:gray")],
     "elements (% of finite values)", "linear"),
)


def _series(res: Any) -> dict[str, list[float]]:
    out = {k: [lv.metrics[k] for lv in res.levels] for k in res.levels[0].metrics}
    out["relative_error_pct"] = [v * 100 for v in out["relative_error"]]
    out["overflow_pct"] = [lv.overflow_ratio * 100 for lv in res.levels]
    out["underflow_pct"] = [lv.underflow_ratio * 100 for lv in res.levels]
    out["flush_pct"] = [lv.flush_to_zero_ratio * 100 for lv in res.levels]
    out["composite"] = list(res.scores)
    return out


def _finite(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    return [p[0] for p in pts], [p[1] for p in pts]


def _mark_levels(ax, res: Any) -> None:
    """Alignment boundaries and the recommended level, on every panel."""
    al = res.plan.alignment
    lo, hi = min(res.plan.levels), max(res.plan.levels)
    pad = max((hi - lo) * 0.02, 1e-9)
    for value, label, color in ((al.max_align, "max alignment", "tab:red"),
                                (al.min_align, "min alignment", "tab:blue")):
        if value is not None and lo - pad <= value <= hi + pad:
            ax.axvline(value, color=color, linestyle="--", linewidth=1, alpha=0.7, label=label)
    if res.recommendation is not None:
        ax.axvline(res.recommendation.scale_exp, color="gold", linewidth=2, alpha=0.8,
                   label=f"recommended s = {res.recommendation.scale_exp:.2f}")
    if lo == hi:  # one exponent: a readable axis around it instead of +-0.05
        ax.set_xlim(lo - 1, hi + 1)


def _draw_panel(ax, res: Any, data: dict[str, list[float]], title: str, lines, ylabel: str,
                kind: str) -> None:
    xs = [lv.scale_exp for lv in res.levels]
    positives: list[float] = []
    drawn = 0
    for key, label, color in lines:
        fx, fy = _finite(xs, data[key])
        if not fy:
            continue
        ax.plot(fx, fy, marker="o", markersize=3, color=color, label=label)
        positives += [y for y in fy if y > 0]
        drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no finite values\n(e.g. exact at every level)", ha="center",
                va="center", transform=ax.transAxes)
        ax.set_xlim(min(xs) - 1, max(xs) + 1)
    elif kind == "auto" and positives and max(positives) / min(positives) > 10:
        ax.set_yscale("log")
    _mark_levels(ax, res)
    rec = None if res.recommendation is None else res.recommendation.index
    first, label = lines[0][0], lines[0][1]
    ax.set_title(title)
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.text(0.02, 0.98, _stats_box(xs, data[first], label, rec), transform=ax.transAxes,
            va="top", ha="left", fontsize=8,
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8})
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best", framealpha=0.7)
    for note in res.says("plot_note"):
        ax.text(0.5, 0.03, note, transform=ax.transAxes, ha="center", va="bottom", fontsize=8,
                color="darkred", wrap=True,
                bbox={"boxstyle": "round", "facecolor": "mistyrose", "alpha": 0.9})


def _stats_box(xs: Sequence[float], ys: Sequence[float], label: str, rec: int | None) -> str:
    """Range of the first series and its value at the recommended level (if any)."""
    fx, fy = _finite(xs, ys)
    lines = [f"{label} at recommended s = {xs[rec]:.2f}: {ys[rec]:.4g}" if rec is not None
             else f"{label}: no level recommended"]
    if len(fy) > 1 and min(fy) == max(fy):
        lines.append(f"{fy[0]:.4g} at every level")
    elif len(fy) > 1:
        lo, hi = min(fy), max(fy)
        lines.append(f"min {lo:.4g} (s = {fx[fy.index(lo)]:.2f}), "
                     f"max {hi:.4g} (s = {fx[fy.index(hi)]:.2f})")
    return "\n".join(lines)


def _save(fig, path: Path, dpi: int) -> Path:
    try:
        with atomic_path(path, make_parents=True) as tmp:
            fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def plot_sweep(res: Any, path: str | os.PathLike[str], tensor_name: str = "",
               dpi: int = 100) -> Path:
    """The six-panel figure (:func:`sweep_figure`) written to ``path``."""
    return _save(sweep_figure(res, tensor_name), Path(path), dpi)


def sweep_figure(res: Any, tensor_name: str = ""):
    """The six-panel figure: MSE/RMSE, cosine, PSNR, MAE/max error, relative error, and
    overflow/underflow/flush-to-zero ratios against the scale exponent."""
    data = _series(res)
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    for ax, (title, lines, ylabel, kind) in zip(axes.ravel(), PANELS):
        _draw_panel(ax, res, data, title, lines, ylabel, kind)
    g = res.grid
    fig.suptitle(f"MXFP scaling test: {tensor_name or 'tensor'} as {res.format_name} "
                 f"(max normal {g.max_normal:g}, min normal {g.min_normal:g}); "
                 + (f"{len(res.levels)} levels from {res.plan.min_exp:.2f} to {res.plan.max_exp:.2f}"
                    if len(res.levels) > 1 else f"1 level at {res.plan.max_exp:.2f}"))
    bottom = _caption(fig, res)
    fig.tight_layout(rect=(0, bottom, 1, 0.96))
    return fig


def _caption(fig, res: Any) -> float:
    """The plot note (why the figure is sparse) as a caption under the panels; returns the
    fraction of the figure height it takes."""
    notes = res.says("plot_note")
    if not notes:
        return 0.0
    fig.text(0.5, 0.005, " ".join(notes), ha="center", va="bottom", fontsize=11,
             color="darkred")
    return 0.035


def plot_summary(res: Any, path: str | os.PathLike[str], tensor_name: str = "",
                 dpi: int = 100) -> Path:
    """The summary figure (:func:`summary_figure`) written to ``path``."""
    return _save(summary_figure(res, tensor_name), Path(path), dpi)


def summary_figure(res: Any, tensor_name: str = ""):
    """The summary figure: MSE, cosine similarity, PSNR and the composite score, with the
    recommended level and a text box of the recommendation (or why there is none)."""
    data = _series(res)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    table = (("mse", "Mean squared error", "MSE (value²)", "tab:blue", "auto"),
             ("cosine_similarity", "Cosine similarity", "cosine similarity", "tab:green", "linear"),
             ("psnr", "PSNR", "PSNR (dB, peak = max |x|)", "tab:purple", "linear"),
             ("composite", "Composite score (MSE 30%, cosine 30%, PSNR 20%, MAE 10%, rel. 10%)",
              "composite score (0-1, 1 = best)", "black", "linear"))
    for ax, (key, title, ylabel, color, kind) in zip(axes.ravel(), table):
        _draw_panel(ax, res, data, title, [(key, key, color)], ylabel, kind)
    rec = res.recommendation
    if rec is None:
        text = "\n".join(res.says("recommendation") + res.says("plot_note"))
    else:
        lv = res.levels[rec.index]
        text = (f"Recommended: s = {rec.scale_exp:.2f} (factor {lv.scale_factor:.6g})\n"
                f"composite {rec.composite_score:.4f}, MSE {lv.metrics['mse']:.3e}, "
                f"cosine {lv.metrics['cosine_similarity']:.6f}, PSNR {lv.metrics['psnr']:.2f} dB\n"
                f"overflow {lv.overflow_ratio * 100:.2f}%, underflow {lv.underflow_ratio * 100:.2f}%")
    fig.text(0.5, 0.005, text, ha="center", va="bottom", fontsize=10, wrap=True,
             bbox={"boxstyle": "round", "facecolor": "lightyellow", "alpha": 0.9})
    fig.suptitle(f"MXFP scaling summary: {tensor_name or 'tensor'} as {res.format_name}")
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    return fig
