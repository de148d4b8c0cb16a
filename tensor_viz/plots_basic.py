"""The first visualizer's folders distributions/, heatmaps/, attention_maps/, comparisons/, statistics/,
attention_analysis/: what the values look like, per group of tensors."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import PowerNorm
from matplotlib.ticker import MaxNLocator

from tensor_capture import schema
from tensor_capture import stats as capture_stats
from tensor_viz.data import Dataset, group, stat, values
from tensor_viz.figures import (
    COUNT_AXIS,
    FILES_AXIS,
    LOG2_AXIS,
    UNITLESS,
    VALUE_AXIS,
    FigureSet,
    Subset,
    colorbar,
    grid,
    legend_below,
    legend_outside,
    overlay_density,
    paginate,
    short,
    value_boxes,
)
from tensor_viz.file_reads import PROBABILITY_NAMES, SCORE_NAMES

PANELS_PER_PAGE = 12     # histogram / Q-Q panels per figure; more groups go on further pages
BOXES_PER_PAGE = 30
HEAT_PANELS = 9
LOG2_REACH = 24          # format limits this many binades beyond the data are drawn, others named
LIMIT_COLOURS = ("tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:cyan", "tab:pink")


def _group_key(e):
    return f"{e.name.quant_type} {e.name.operation} {e.name.tensor_name}"


def _hist(ax, v: np.ndarray, label: str | None = None, density: bool = False, **kw) -> None:
    if v.size:
        ax.hist(v, bins=80, histtype="step" if label else "stepfilled", label=label,
                density=density, alpha=0.9 if label else 0.7, **kw)


def draw_distributions(ds: Dataset, fs: FigureSet) -> None:
    section = "distributions"
    groups = {k: g for k, g in group(ds.sampled(), _group_key).items()}
    if not groups:
        fs.placeholder(section, "no tensor values could be read")
    else:
        keys = list(groups)
        for suffix, page, note in paginate(keys, PANELS_PER_PAGE, "groups"):
            fig, axes = grid(len(page))
            for ax, k in zip(axes, page):
                _hist(ax, values(groups[k]))
                ax.set_yscale("log")
                ax.set(title=short(k), xlabel=VALUE_AXIS, ylabel=COUNT_AXIS)
            fs.save(fig, section, "value_histograms" + suffix, "Value histograms by quant type, pass and tensor",
                    "Sampled values per group (log count). Look for heavy tails, spikes at a format's "
                    "largest value (saturation) and a spike at zero (values flushed to zero).", note)
        for suffix, page, note in paginate(keys, BOXES_PER_PAGE, "groups"):
            fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(page) + 2), 4.5))
            scale = value_boxes(ax, [values(groups[k]) for k in page])
            ax.set_xticks(range(1, len(page) + 1), [short(k, 28) for k in page], rotation=45, ha="right")
            ax.set(xlabel="group (quant type, pass, tensor)")
            fs.save(fig, section, "box_plots" + suffix, "Box plots of sampled values by group",
                    "Boxes span the 25th-75th percentile, whiskers 1.5 IQR. Very different spreads "
                    "between groups mean one scale cannot fit them all. " + scale, note)
        for suffix, page, note in paginate(keys, PANELS_PER_PAGE, "groups"):
            fig, axes = grid(len(page))
            for ax, k in zip(axes, page):
                v = np.sort(values(groups[k]))
                if v.size >= 8 and v.std() > 0:
                    z = (v - v.mean()) / v.std()
                    p = (np.arange(v.size) + 0.5) / v.size
                    theo = torch.special.ndtri(torch.from_numpy(p)).numpy()
                    ax.plot(theo, z, ".", ms=2)
                    lim = max(abs(theo).max(), 1.0)
                    ax.plot([-lim, lim], [-lim, lim], "r--", lw=1)   # the caption names it
                ax.set(title=short(k), xlabel="normal quantile (standard deviations)",
                       ylabel="sample z-score (standard deviations)")
            fs.save(fig, section, "qq_plots" + suffix, "Q-Q plots against a normal distribution",
                    "Red dashed diagonal: a normal distribution. Points leaving it at the ends mean heavier tails than a normal: "
                    "those tensors need exponent range more than mantissa bits.", note)
    _draw_log2(ds, fs)


def merge_log2_hist(hists) -> tuple[int, np.ndarray]:
    """Sum binade histograms with different origins: returns (min_exp, counts)."""
    hists = [(int(h["min_exp"]), np.asarray(h["counts"], dtype=np.float64)) for h in hists
             if isinstance(h, dict) and h.get("counts")]
    if not hists:
        return 0, np.zeros(0)
    lo = min(e0 for e0, _ in hists)
    hi = max(e0 + c.size for e0, c in hists)
    acc = np.zeros(hi - lo)
    for e0, c in hists:
        acc[e0 - lo:e0 - lo + c.size] += c
    return lo, acc


def _draw_log2(ds: Dataset, fs: FigureSet) -> None:
    """Binade histogram over all tensors from stored stats (no values read)."""
    section = "distributions"
    by_op = group(ds.with_stats(), lambda e: e.name.operation)
    merged = {op: merge_log2_hist([(e.stats or {}).get(schema.STAT_LOG2_HIST) for e in es])
              for op, es in by_op.items()}
    merged = {op: h for op, h in merged.items() if h[1].size}
    if not merged:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for op, (e0, counts) in merged.items():
        ax.step(np.arange(e0, e0 + counts.size), counts, where="post", label=op)
    ax.set_yscale("log")
    # The x range follows the data and the limits near it: a limit far outside (bf16's 2^-133)
    # would squeeze every histogram into a few pixels. Such limits are named in the caption.
    lo = min(e0 for e0, _ in merged.values()) - LOG2_REACH
    hi = max(e0 + c.size for e0, c in merged.values()) + LOG2_REACH
    outside, drawn = [], []
    colours = iter(LIMIT_COLOURS * 4)
    for qt in sorted({e.name.quant_type for e in ds.entries}):
        spec = capture_stats.format_range(qt)
        if spec is None:
            continue
        colour = next(colours)
        for value, style, what in ((spec.max_normal, "--", "max"), (spec.min_subnormal, ":", "min subnormal")):
            exp = math.log2(value)
            text = f"{qt} {what} ($2^{{{exp:.0f}}}$)"
            if not lo <= exp <= hi:
                outside.append(text.replace("$2^{", "2^").replace("}$", ""))
                continue
            ax.axvline(exp, ls=style, lw=1, color=colour, label=text)
            drawn.append(exp)
    data_lo = min(e0 for e0, _ in merged.values())
    data_hi = max(e0 + c.size for e0, c in merged.values())
    ax.set_xlim(min([data_lo] + drawn) - 2, max([data_hi] + drawn) + 2)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set(xlabel=LOG2_AXIS, ylabel=COUNT_AXIS)
    fs.save(fig, section, "log2_magnitude", "Magnitude (binade) histogram of all captured values",
            "From the statistics stored at capture time, so every value of every tensor counts. "
            "Vertical lines: each format's largest (dashed) and smallest subnormal (dotted) value; "
            "mass right of the dashed line overflows, mass left of the dotted line flushes to zero."
            + (f" Limits outside the data's range, not drawn: {', '.join(outside)}." if outside else ""))


#: colour bar label of a probability map: softmax outputs, 0..1, square-root colour steps
PROBABILITY_AXIS = "probability (fraction, 0-1, sqrt colour scale)"


def _heat_panels(fs: FigureSet, section: str, entries, name: str, title: str, caption: str,
                 xlabel: str, ylabel: str, subset: Subset) -> None:
    """One panel per tensor. Signed values on a diverging scale centred on zero; softmax
    probabilities on a sequential 0-1 scale (on a -1..1 diverging scale they are all near its
    white middle), with square-root steps so that the 1/n of a long row still shows."""
    # Wide gaps: each panel carries a colourbar with its own label, right next to the
    # following panel's y label.
    fig, axes = grid(len(entries), ncols=3, size=(5.2, 4.2), wspace=0.6)
    for ax, e in zip(axes, entries):
        m = np.nan_to_num(e.heat.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        if e.name.tensor_name in PROBABILITY_NAMES:
            im = ax.imshow(m, aspect="auto", cmap="viridis", norm=PowerNorm(0.5, vmin=0.0, vmax=1.0),
                           interpolation="nearest")
            colorbar(fig, im, ax, PROBABILITY_AXIS)
        else:
            vmax = float(np.abs(m).max()) or 1.0
            im = ax.imshow(m, aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
            colorbar(fig, im, ax, VALUE_AXIS)
        ax.grid(False)
        # Two lines instead of a cut: the label, then where it was captured.
        ax.set(title=f"{short(e.label, 46)}\niteration {e.name.iteration}, {e.name.quant_type}",
               xlabel=xlabel, ylabel=ylabel)
    fs.save(fig, section, name, title, caption, subset)


def _crest(e) -> float:
    """absmax / std of the read block: how far the largest value stands out."""
    m = np.abs(e.heat[np.isfinite(e.heat)])
    return float(m.max() / m.std()) if m.size and m.std() > 0 else 0.0


def draw_heatmaps(ds: Dataset, fs: FigureSet) -> None:
    section = "heatmaps"
    with_heat = list({e.label: e for e in ds.entries if e.heat is not None}.values())
    if not with_heat:
        fs.placeholder(section, "no tensor values could be read")
        return
    picked = sorted(with_heat, key=_crest, reverse=True)[:HEAT_PANELS]
    n_labels = len({e.label for e in ds.entries})
    subset = Subset(len(picked), n_labels, "tensors",
                    f"chosen by the largest absmax / std of the block (outliers first) among the "
                    f"{len(with_heat)} tensors whose block was read (the first in reading order)")
    _heat_panels(fs, section, picked, "value_heatmaps", "Tensor values (first 128 x 128 block)",
                 "Each cell is one value. Bright isolated stripes are outlier channels (columns) "
                 "or tokens (rows): per-channel or block scaling handles them, one tensor scale does not.",
                 "column (last dimension index)", "row (leading dims flattened)", subset)


def draw_attention_maps(ds: Dataset, fs: FigureSet) -> None:
    section = "attention_maps"
    scores = [e for e in ds.entries if e.heat is not None and e.name.tensor_name in SCORE_NAMES]
    if not scores:
        fs.placeholder(section, "no attention score/probability tensors were captured (tensor names "
                       + ", ".join(SCORE_NAMES) + ")")
        return
    n_scores = sum(1 for e in ds.entries if e.name.tensor_name in SCORE_NAMES)
    picked = scores[:HEAT_PANELS]
    subset = Subset(len(picked), n_scores, "score tensors", "the first in reading order whose block was read")
    _heat_panels(fs, section, picked, "attention_score_maps", "Attention score maps (first head)",
                 "Rows are query positions, columns key positions. Probabilities are on a 0-1 "
                 "sequential scale (square-root colour steps: 0.25 sits mid-scale); scores on a "
                 "scale centred on zero. A few very bright columns (attention sinks) set the range "
                 "the format must hold.", "key position (token index)", "query position (token index)",
                 subset)


def draw_comparisons(ds: Dataset, fs: FigureSet) -> None:
    section = "comparisons"
    by_q = group(ds.sampled(), lambda e: e.name.quant_type)
    if not by_q:
        fs.placeholder(section, "no tensor values could be read")
        return
    overlay_density(fs, section, "quant_type_distributions",
                    {f"{qt} ({len(es)} files)": values(es) for qt, es in by_q.items()},
                    "Value distributions by quant type",
            "Same-shaped curves mean the quant type did not change the values' distribution; "
            "a wider curve (larger tails) under one format points at growing activations.")
    by_q_stats = group(ds.with_stats(), lambda e: e.name.quant_type)
    keys = [k for k in by_q_stats]
    if keys:
        fig, axes = grid(2, ncols=2, size=(max(4.6, 0.9 * len(keys) + 2), 4.2))
        for ax, key in zip(axes, ("std", "absmax")):
            data = [[v for e in by_q_stats[k] if (v := stat(e, key)) is not None] or [np.nan] for k in keys]
            ax.boxplot(data, showfliers=True)
            ax.set_xticks(range(1, len(keys) + 1), keys, rotation=30, ha="right")
            ax.set_yscale("log")
            ax.set(title=f"per-file {key}", xlabel="quant type", ylabel=f"{key} ({UNITLESS}, log scale)")
        fs.save(fig, section, "quant_type_stats", "Per-file std and absmax by quant type",
                "From stored statistics of every file. A format whose absmax box sits far above "
                "the others is where overflow starts.")


def draw_statistics(ds: Dataset, fs: FigureSet) -> None:
    section = "statistics"
    es = ds.with_stats()
    if not es:
        fs.placeholder(section, "no statistics were stored or could be computed")
        return
    fig, axes = grid(2, ncols=2, size=(6, 4.2))
    for ax, key in zip(axes, ("absmax", "std")):
        for op, g in group(es, lambda e: e.name.operation).items():
            xs = [e.name.layer_idx if e.name.layer_idx is not None else -1 for e in g]
            ys = [stat(e, key) or np.nan for e in g]
            ax.scatter(xs, ys, s=12, label=op, alpha=0.7)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        legend_below(ax, fontsize=8)
        ax.set(title=f"{key} per file", xlabel="layer index (-1 = none)", ylabel=f"{key} ({UNITLESS}, log scale)")
    fs.save(fig, section, "stats_by_layer", "Absolute maximum and standard deviation by layer",
            "Each point is one captured tensor. A rising trend with depth means later layers need more range.")
    counts = group(ds.entries, lambda e: f"{e.name.layer_type}/{e.name.operation}")
    nan_inf = group(es, lambda e: e.name.quant_type)
    fig, axes = grid(2, ncols=2, size=(6, 4.2))
    axes[0].bar(list(counts), [len(v) for v in counts.values()])
    axes[0].set(title="files per layer type / pass", xlabel="layer type / pass", ylabel=FILES_AXIS)
    axes[0].tick_params(axis="x", rotation=30)
    width = 0.25
    keys = list(nan_inf)
    x = np.arange(len(keys))
    for i, key in enumerate(("zero_count", "nan_count", "inf_count")):
        ys = []
        for k in keys:
            tot = sum(stat(e, "numel") or 0 for e in nan_inf[k]) or 1
            ys.append(100.0 * sum(stat(e, key) or 0 for e in nan_inf[k]) / tot)
        axes[1].bar(x + (i - 1) * width, ys, width, label=key.replace("_count", ""))
    axes[1].set_xticks(x, keys, rotation=30, ha="right")
    legend_outside(axes[1], fontsize=8)
    axes[1].set(title="zeros, NaN, Inf", xlabel="quant type", ylabel="share of elements (%)")
    fs.save(fig, section, "counts", "Files captured, and zeros / NaN / Inf by quant type",
            "Any NaN or Inf bar above zero is a divergence to chase first; many zeros can mean flush-to-zero.")


def draw_attention_analysis(ds: Dataset, fs: FigureSet) -> None:
    section = "attention_analysis"
    att = [e for e in ds.entries if e.name.layer_type == "attention"]
    if not att:
        fs.placeholder(section, "no attention tensors were captured")
        return
    by_t = group(ds.sampled(att), lambda e: f"{e.name.operation} {e.name.tensor_name}")
    if by_t:
        overlay_density(fs, section, "qkv_context_distributions", {k: values(es) for k, es in by_t.items()},
                        "Attention inputs and outputs: value distributions",
                "Query/key tails wider than value/context tails are typical; keys with extreme "
                "values saturate low-precision score computations.")
    stats_t = group([e for e in att if e.stats], lambda e: e.name.tensor_name)
    if stats_t:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        colours = plt.get_cmap("tab20").colors      # more than ten tensors: no repeated colour
        for n, (k, es) in enumerate(stats_t.items()):
            by_l = group(es, lambda e: e.name.layer_idx if e.name.layer_idx is not None else -1)
            ax.plot(list(by_l), [np.nanmax([stat(e, "absmax") or np.nan for e in g]) for g in by_l.values()],
                    "-", marker="os^D"[n // len(colours) % 4], color=colours[n % len(colours)], label=k)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        legend_outside(ax, fontsize=8, title="tensor", title_fontsize=8)
        ax.set(xlabel="layer index (0-based)", ylabel=f"absmax ({UNITLESS}, log scale)")
        fs.save(fig, section, "absmax_by_layer", "Attention tensors: largest magnitude per layer",
                "The layer where a curve jumps is where attention values start to need more range.")
