"""The analysis folders overflow_analysis/, fp8_analysis/, bf16_analysis/, backward_analysis/,
layer_analysis/, rank_analysis/: each compares the captured tensors along one axis (format range,
run format, pass, layer, rank)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from tensor_capture import schema
from tensor_viz.data import Dataset, group, ks_normal, moments, ratio, stat, values
from tensor_viz.figures import (
    COUNT_AXIS,
    DENSITY_AXIS,
    FILES_AXIS,
    LOG2_AXIS,
    PERCENT_AXIS,
    UNITLESS,
    VALUE_AXIS,
    FigureSet,
    Subset,
    grid,
    legend_below,
    legend_outside,
    magnitude_spread,
    overlay_density,
    short,
    stat_boxes,
    value_boxes,
)

RANK_PANELS = 8
#: Histograms (80 bins) sharing an axis whose groups' typical magnitudes differ by more than
#: this are drawn as binades: a group 10x narrower than the axis fills fewer than 8 bins.
HIST_SPREAD = 10.0


def _hist(ax, v, label=None, density=True):
    if v.size:
        ax.hist(v, bins=80, histtype="step", density=density, label=label)


def draw_overflow(ds: Dataset, fs: FigureSet) -> None:
    section = "overflow_analysis"
    es = [e for e in ds.entries if e.range_stats() is not None]
    if not es:
        fs.placeholder(section, "no overflow statistics (capture stored none, and no format limits "
                       "were known to compute them)")
        return
    by_q = group(es, lambda e: e.name.quant_type)
    keys = list(by_q)
    x = np.arange(len(keys))
    tot = np.array([100 * (ratio(e, "overflow_ratio") or 0) for e in es])
    caption = ("Overflow = |x| above the format's largest normal value. Any non-zero bar is data the format "
               "clips; points far from the diagonal in the scatter mean one-sided (signed) outliers.")
    if not tot.any():
        # Nothing overflows: three panels of zeros say less than one sentence. Keep the panel
        # that still has data (underflow and flush-to-zero by layer type) and say it in the title.
        fig, ax = plt.subplots(figsize=(7.5, 4.3))
        _by_layer_type(ax, group(es, lambda e: e.name.layer_type))
        fs.save(fig, section, "overflow_ratios",
                f"No overflow in any of the {len(es)} tensors (each against its own format's range)",
                f"No value of any tensor ({', '.join(keys)}) exceeds its format's largest normal value, so the "
                "overflow panels (by quant type, upper vs lower, per file) are left out; the panel shows "
                "what the ranges do cut: underflow and flush-to-zero per layer type.")
    else:
        fig, axes = grid(4, ncols=2, size=(6.2, 4.3))
        mean = [100 * np.mean([ratio(e, "overflow_ratio") or 0 for e in by_q[k]]) for k in keys]
        worst = [100 * max(ratio(e, "overflow_ratio") or 0 for e in by_q[k]) for k in keys]
        axes[0].bar(x - 0.2, mean, 0.4, label="mean over files")
        axes[0].bar(x + 0.2, worst, 0.4, label="worst file")
        axes[0].set_xticks(x, keys, rotation=30, ha="right")
        legend_below(axes[0], fontsize=8)
        axes[0].set(title="overflow ratio by quant type", xlabel="quant type", ylabel=PERCENT_AXIS)
        for qt, g in by_q.items():
            axes[1].scatter([100 * (ratio(e, "upper_overflow_ratio") or 0) for e in g],
                            [100 * (ratio(e, "lower_overflow_ratio") or 0) for e in g], s=14, label=qt, alpha=0.7)
        legend_outside(axes[1], fontsize=8)
        axes[1].set(title="upper (x > max) vs lower (x < -max)", xlabel="upper overflow (% of elements)",
                    ylabel="lower overflow (% of elements)")
        _by_layer_type(axes[2], group(es, lambda e: e.name.layer_type))
        axes[3].hist(tot, bins=40)
        axes[3].set(title="total overflow ratio over files", xlabel="overflow (% of elements)", ylabel=FILES_AXIS)
        # Ratios cannot be negative: keep the axes at >= 0.
        axes[0].set_ylim(bottom=0)
        axes[1].set_xlim(left=0)
        axes[1].set_ylim(bottom=0)
        axes[3].set_xlim(left=0)
        fs.save(fig, section, "overflow_ratios", "Overflow ratios (against each tensor's own format range)", caption)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, key in enumerate(("underflow_ratio", "flush_to_zero_ratio")):
        ax.bar(x + (i - 0.5) * 0.4, [100 * np.mean([ratio(e, key) or 0 for e in by_q[k]]) for k in keys],
               0.4, label=key.replace("_ratio", "").replace("_", " "))
    ax.set_xticks(x, keys, rotation=30, ha="right")
    legend_outside(ax)
    ax.set(xlabel="quant type", ylabel=PERCENT_AXIS)
    fs.save(fig, section, "underflow_ratios", "Underflow and flush-to-zero by quant type",
            "Underflow = nonzero |x| below the smallest normal (precision lost); flush-to-zero = below "
            "half the smallest subnormal (value becomes 0). High values here point at gradients.")


def _by_layer_type(ax, by_l: dict) -> None:
    """Mean overflow, underflow and flush-to-zero per layer type, as grouped bars."""
    lk = list(by_l)
    xl = np.arange(len(lk))
    for i, key in enumerate(("overflow_ratio", "underflow_ratio", "flush_to_zero_ratio")):
        ax.bar(xl + (i - 1) * 0.27, [100 * np.mean([ratio(e, key) or 0 for e in by_l[k]]) for k in lk],
               0.27, label=key.replace("_ratio", "").replace("_", " "))
    ax.set_xticks(xl, lk)
    legend_below(ax, fontsize=8)
    ax.set(title="by layer type (mean over files)", xlabel="layer type", ylabel=PERCENT_AXIS)


def _is_mxfp8(qt: str) -> bool:
    return qt.startswith("mxfp8")


def draw_fp8(ds: Dataset, fs: FigureSet) -> None:
    section = "fp8_analysis"
    hi = [e for e in ds.entries if e.name.quant_type == "hifp8"]
    mx = [e for e in ds.entries if _is_mxfp8(e.name.quant_type)]
    if not hi or not mx:
        found = sorted({e.name.quant_type for e in ds.entries})
        fs.placeholder(section, f"needs captures under both hifp8 and mxfp8; found {', '.join(found) or 'none'}")
        return
    sets = {"hifp8": hi, "mxfp8": mx}
    if ds.sampled(hi + mx):
        _draw_fp8_values(ds, fs, sets)
    _draw_fp8_stats(fs, sets)


def _draw_fp8_values(ds: Dataset, fs: FigureSet, sets: dict) -> None:
    section = "fp8_analysis"
    overlay_density(fs, section, "hifp8_vs_mxfp8_distribution",
                    {f"{k} ({len(es)} files)": values(ds.sampled(es)) for k, es in sets.items()},
                    "HiFP8 vs MXFP8: value distributions",
            "Runs under the two formats should see similar values; diverging tails mean one run's "
            "activations grew (an early sign of divergence).")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, es in sets.items():
        d = [v for e in ds.sampled(es) if (v := ks_normal(e.sample)) is not None]
        if d:
            ax.hist(d, bins=30, histtype="step", label=f"{k} (median D = {np.median(d):.3f})")
    legend_outside(ax)
    ax.set(xlabel="Kolmogorov-Smirnov distance to a normal (0 = normal)", ylabel=FILES_AXIS)
    fs.save(fig, section, "normal_fit", "Goodness of fit to a normal distribution",
            "Small D: roughly Gaussian values; large D: heavy tails or spikes (e.g. many exact zeros).")


def _draw_fp8_stats(fs: FigureSet, sets: dict) -> None:
    section = "fp8_analysis"
    hi, mx = sets["hifp8"], sets["mxfp8"]
    fig, axes = grid(4, ncols=4, size=(3.8, 3.8), wspace=0.5)
    for ax, key in zip(axes, ("mean", "std", "min", "max")):
        stat_boxes(ax, [[v for e in es if (v := stat(e, key)) is not None] for es in sets.values()], key)
        ax.set_xticks([1, 2], list(sets))
        ax.set(title=key, xlabel="format")
    fs.save(fig, section, "stat_boxplots", "HiFP8 vs MXFP8: per-file mean, std, min, max",
            "Boxes that do not overlap mean the two runs differ systematically, not by noise.")
    key_fn = lambda e: (e.name.layer_type, e.name.layer_idx, e.name.operation, e.name.tensor_name)  # noqa: E731
    a, b = group(hi, key_fn), group(mx, key_fn)
    common = [k for k in a if k in b]
    fig, axes = grid(2, ncols=2, size=(5, 4.5))
    for ax, key in zip(axes, ("std", "absmax")):
        xs = [np.nanmean([stat(e, key) or np.nan for e in a[k]]) for k in common]
        ys = [np.nanmean([stat(e, key) or np.nan for e in b[k]]) for k in common]
        ax.scatter(xs, ys, s=16)
        ok = np.isfinite(xs) & np.isfinite(ys) if common else np.zeros(0, bool)
        r = np.corrcoef(np.asarray(xs)[ok], np.asarray(ys)[ok])[0, 1] if ok.sum() >= 2 else np.nan
        if ok.any():
            lim = [min(np.min(np.asarray(xs)[ok]), np.min(np.asarray(ys)[ok])),
                   max(np.max(np.asarray(xs)[ok]), np.max(np.asarray(ys)[ok]))]
            ax.plot(lim, lim, "r--", lw=1)
        if ok.any() and np.all(np.asarray(xs)[ok] > 0) and np.all(np.asarray(ys)[ok] > 0):
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set(title=f"{key}: Pearson r = {r:.3f} ({len(common)} tensors)",
               xlabel=f"hifp8 {key} ({UNITLESS}, log scale)", ylabel=f"mxfp8 {key} ({UNITLESS}, log scale)")
    fs.save(fig, section, "correlation", "Same tensor under HiFP8 and MXFP8",
            "Each point is one tensor name at one layer and pass (averaged over iterations). Points on "
            "the red diagonal agree; r well below 1 means the formats changed the training trajectory.")


def draw_bf16(ds: Dataset, fs: FigureSet) -> None:
    section = "bf16_analysis"
    es = ds.sampled([e for e in ds.entries if e.name.quant_type == "bf16" or e.dtype == "torch.bfloat16"])
    if not es:
        fs.placeholder(section, "no bf16 tensors (quant type bf16 or dtype bfloat16) could be read")
        return
    v = values(es)
    fig, axes = grid(4, ncols=2, size=(6, 4.2))
    axes[0].hist(v, bins=100)
    axes[0].set_yscale("log")
    axes[0].set(title="raw distribution", xlabel=VALUE_AXIS, ylabel=COUNT_AXIS)
    lo, hi = (float(v.min()), float(v.max())) if v.size else (0.0, 1.0)
    span = (hi - lo) or 1.0
    norm = (v - lo) / span
    axes[1].hist(norm, bins=100, density=True)
    axes[1].set(title="normalized to [0, 1]", xlabel="(x - min) / (max - min) (unitless)",
                ylabel="density (per unit of normalized value)")
    raw_d, _ = np.histogram(v, bins=100, density=True)
    norm_d, _ = np.histogram(norm, bins=100, range=(0, 1), density=True)
    centers = (np.arange(100) + 0.5) / 100
    axes[2].plot(centers, raw_d, label="raw density (per unit of value)")
    axes[2].plot(centers, norm_d, "--", label="normalized density (per unit of normalized value)")
    axes[2].set_yscale("log")
    legend_below(axes[2], fontsize=8)
    axes[2].set(title=f"raw vs normalized (factor {span:.3g})", xlabel="position in [min, max] (unitless)",
                ylabel="density (log)")
    m = np.array([moments(e.sample) for e in es])
    axes[3].boxplot([m[:, 0], m[:, 1], m[:, 2]])
    axes[3].set_xticks([1, 2, 3], ["variance", "skewness", "excess kurtosis"])
    axes[3].set_yscale("symlog")
    axes[3].set(title="per-file shape statistics", xlabel="statistic", ylabel="value (unitless, symlog)")
    fs.save(fig, section, "bf16_distribution", f"BF16 tensors ({len(es)} files)",
            "The normalized density differs from the raw one by the factor (max - min). High kurtosis "
            "means a few huge values: fine for BF16's range, a problem after casting to FP8.")


def draw_backward(ds: Dataset, fs: FigureSet) -> None:
    section = "backward_analysis"
    bwd = [e for e in ds.entries if e.name.operation == "backward"]
    if not bwd:
        fs.placeholder(section, "no backward-pass tensors were captured")
        return
    fwd = [e for e in ds.entries if e.name.operation == "forward"]
    if ds.sampled(bwd):
        _draw_backward_values(ds, fs, fwd, bwd)
    _draw_backward_stats(ds, fs, fwd, bwd)


def _draw_backward_values(ds: Dataset, fs: FigureSet, fwd, bwd) -> None:
    section = "backward_analysis"
    fig, axes = grid(2, ncols=2, size=(6, 4.8))
    panels = (("forward vs backward", {f"{label} ({len(es)} files)": values(ds.sampled(es))
                                       for label, es in (("forward", fwd), ("backward", bwd))}),
              ("backward by layer type", {lt: values(ds.sampled(es))
                                          for lt, es in group(bwd, lambda e: e.name.layer_type).items()}))
    binades = []
    for ax, (title, series) in zip(axes, panels):
        # Gradients next to activations: on one linear axis the gradients are a spike at zero,
        # so such a panel shows binades (log2 |x|, zeros left out) instead.
        spread = magnitude_spread([v for v in series.values() if v.size])
        for label, v in series.items():
            if spread > HIST_SPREAD:
                v = np.abs(v)
                v = np.log2(v[v > 0])
            _hist(ax, v, label=label)
        ax.set_yscale("log")
        legend_below(ax, fontsize=8)
        ax.set(title=title, xlabel=LOG2_AXIS if spread > HIST_SPREAD else VALUE_AXIS, ylabel=DENSITY_AXIS
               if spread <= HIST_SPREAD else "density (1 / binade)")
        if spread > HIST_SPREAD:
            binades.append(f"'{title}' shows log2 |value| (zeros left out) because its groups' typical "
                           f"magnitudes differ by {spread:.2g}x")
    fs.save(fig, section, "forward_vs_backward", "Forward vs backward value distributions",
            "Gradients are usually orders of magnitude smaller than activations: that gap is why "
            "backward passes use E5M2 (more range) or scaling." + "".join(f" Panel {b}." for b in binades))
    grads = ds.sampled([e for e in bwd if e.name.tensor_name.startswith("grad")]) or ds.sampled(bwd)
    if grads:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for k, es in group(grads, lambda e: e.name.tensor_name).items():
            v = np.abs(values(es))
            v = v[v > 0]
            if v.size:
                ax.hist(np.log2(v), bins=60, histtype="step", label=k)
        legend_outside(ax)
        ax.set(xlabel=LOG2_AXIS, ylabel=COUNT_AXIS)
        fs.save(fig, section, "gradient_magnitudes", "Gradient magnitudes (binades)",
                "Where gradient mass sits on the exponent axis: compare with the format's smallest "
                "normal exponent (e.g. -6 for E4M3, -14 for E5M2) to see what underflows.")


def _draw_backward_stats(ds: Dataset, fs: FigureSet, fwd, bwd) -> None:
    section = "backward_analysis"
    fig, axes = grid(2, ncols=2, size=(5, 4.2))
    for ax, key in zip(axes, ("std", "absmax")):
        ax.boxplot([[v for e in es if (v := stat(e, key))] or [np.nan] for es in (fwd, bwd)])
        ax.set_xticks([1, 2], ["forward", "backward"])
        ax.set_yscale("log")
        ax.set(title=f"per-file {key}", xlabel="pass", ylabel=f"{key} ({UNITLESS}, log scale)")
    fs.save(fig, section, "stats_side_by_side", "Forward vs backward statistics",
            "From stored statistics. A backward absmax several binades below forward needs a "
            "loss scale or per-tensor scaling to stay out of the underflow range.")


def _batch_size(e) -> int | None:
    shape = e.meta.get(schema.META_SHAPE)
    if isinstance(shape, list) and len(shape) >= 3 and e.name.tensor_name != "weight":
        return int(shape[1])  # Megatron activations are [sequence, batch, ...]
    return None


def draw_layers(ds: Dataset, fs: FigureSet) -> None:
    section = "layer_analysis"
    sampled = ds.sampled()
    if not sampled:
        fs.placeholder(section, "no tensor values could be read")
        return
    fig, axes = grid(4, ncols=2, size=(6.2, 4.3))
    for lt, es in group(sampled, lambda e: e.name.layer_type).items():
        _hist(axes[0], values(es), label=f"{lt} ({len(es)} files)")
    axes[0].set_yscale("log")
    legend_below(axes[0], fontsize=8)
    axes[0].set(title="attention vs linear", xlabel=VALUE_AXIS, ylabel=DENSITY_AXIS)
    scales: set[str] = set()
    for ax, (title, key_fn, xlabel) in zip(axes[1:], (
            ("per layer index", lambda e: e.name.layer_idx, "layer index (0-based)"),
            ("per sample (micro-batch) index", lambda e: e.name.sample_idx, "sample index (micro-batch number)"),
            ("per batch size", _batch_size, "batch size (dim 1 of [s, b, ...])"))):
        g = {k: v for k, v in group(sampled, key_fn).items() if k is not None}
        if g:
            scales.add(value_boxes(ax, [values(v) for v in g.values()]))
            ax.set_xticks(range(1, len(g) + 1), [str(k) for k in g])
        else:
            ax.text(0.5, 0.5, "not recorded in these captures", ha="center", transform=ax.transAxes)
            ax.set_ylabel(VALUE_AXIS)
        ax.set(title=title, xlabel=xlabel)
    fs.save(fig, section, "layer_batch_sample", "Values by layer type, layer index, sample and batch size",
            "Growing boxes with depth mean later layers need more range; differences between samples "
            "show whether one micro-batch (one bad example) drives the outliers. " + " ".join(sorted(scales)))


def _rank_outliers(ds: Dataset, fs: FigureSet, section: str) -> None:
    """Outlier ranks from the columnar index (tensor_viz.rank_tables): every record counted."""
    view = ds.rank_view
    if view is None or not view.outliers or view.worst is None:
        return
    fig, axes = grid(2, ncols=2, size=(5.6, 3.8))
    ax = axes[0]
    h = view.header
    span = list(range(h.first_iteration, h.last_iteration + 1)) if (
        h.first_iteration is not None and h.last_iteration - h.first_iteration < 100_000) else None
    for metric, counts in view.per_iteration.items():
        got = dict(counts)
        xs = span if span is not None else sorted(got)
        ax.plot(xs, [got.get(i, 0) for i in xs], marker="." if len(xs) < 60 else None,
                label=metric)
    ax.set(title="outlier cells per iteration", xlabel="iteration",
           ylabel="layer x tensor cells with an outlier rank (count)")
    legend_below(ax, fontsize=7)
    w, band = view.worst, view.worst_band
    ax = axes[1]
    its = [b[0] for b in band]
    ax.fill_between(its, [b[1] for b in band], [b[3] for b in band], alpha=0.25,
                    label="min..max over ranks")
    ax.plot(its, [b[2] for b in band], label="median over ranks")
    ax.plot(its, [np.nan if b[4] is None else b[4] for b in band], marker=".",
            label=f"rank {w['rank']}")
    where = f"L{'NA' if w['layer_idx'] is None else w['layer_idx']} {w['submodule'] or ''} {w['operation']} {w['tensor_name']}"
    ax.set(title=short(f"rank {w['rank']}: {w['metric']} of {where}", 48), xlabel="iteration",
           ylabel=f"{w['metric']} ({_metric_unit(w['metric'])})")
    legend_outside(ax, fontsize=7)
    fs.save(fig, section, "rank_outliers", "Which rank diverged, from which iteration",
            f"From every record of the capture ({h.records:,} records, {h.ranks} ranks, "
            f"{h.iterations} iterations), aggregated in DuckDB over the columnar index. Left: per "
            "iteration, how many layer x tensor cells have a rank far from the median over ranks "
            "(robust z > 3.5). Right: the most extreme rank's value against the band of all ranks, "
            "for the layer and tensor where it was furthest off.")


def _metric_unit(metric: str) -> str:
    """The unit of a rank_tables metric: ratios are fractions of elements, counts count
    elements, absmax and std are values."""
    if metric.endswith("_ratio"):
        return "fraction of elements"
    return "elements" if "count" in metric or "nonfinite" in metric else UNITLESS


def draw_ranks(ds: Dataset, fs: FigureSet) -> None:
    section = "rank_analysis"
    _rank_outliers(ds, fs, section)
    key_fn = lambda e: (e.name.iteration, e.name.layer_type, e.name.layer_idx,  # noqa: E731
                        e.name.operation, e.name.tensor_name, e.name.quant_type, e.name.sample_idx)
    multi = {k: g for k, g in group(ds.with_stats(), key_fn).items()
             if len({e.name.rank for e in g}) > 1}
    ranks = sorted({e.name.rank for e in ds.entries if e.name.rank is not None})
    if not multi:
        fs.placeholder(section, f"every tensor was captured on a single rank (ranks seen: {ranks or 'none'})")
        return
    keys = list(multi)[:RANK_PANELS]
    subset = Subset(len(keys), len(multi), "tensors on several ranks", "the first in iteration, layer and name order")
    fig, axes = grid(len(keys), ncols=4, size=(3.6, 3.4))
    for ax, k in zip(axes, keys):
        g = sorted(multi[k], key=lambda e: e.name.rank or 0)
        ax.bar([str(e.name.rank) for e in g], [stat(e, "absmax") or 0 for e in g])
        ax.set(title=short(f"it{k[0]} L{k[2]} {k[3]} {k[4]}", 32), xlabel="rank", ylabel=f"absmax ({UNITLESS})")
    fs.save(fig, section, "same_tensor_across_ranks", "The same tensor on each rank",
            "With tensor parallelism each rank holds a shard: similar bars are expected; one rank far "
            "above the others holds the outlier channels.", subset)
    imb = []
    for g in multi.values():
        s = [stat(e, "absmax") for e in g]
        s = [v for v in s if v]
        if len(s) > 1:
            imb.append(max(s) / min(s))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.hist(imb, bins=30)
    ax.set(xlabel="max / min absmax across ranks (ratio)", ylabel=FILES_AXIS)
    fs.save(fig, section, "rank_imbalance", "Rank imbalance of the largest magnitude",
            "Ratios near 1: balanced shards. Large ratios: per-tensor scales computed on one rank "
            "do not fit another; use a global amax or block scaling.")
