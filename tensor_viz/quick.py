"""Quick view (first written as script/quick_visualize.py): quick_analysis.png with four panels and
tensor_stats.txt, from stored statistics and a small reproducible sample of values."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from lowp_common import atomic_write_text
from tensor_viz.catalog import Catalog

if TYPE_CHECKING:
    from tensor_viz.data import Dataset
    from tensor_viz.figures import FigureSet


def overall_stats(ds: "Dataset") -> dict[str, float]:
    """Exact totals over every tensor from per-file stats (count-weighted mean and variance)."""
    from tensor_viz.data import stat

    n_tot, s1, s2 = 0, 0.0, 0.0
    lo, hi = math.inf, -math.inf
    for e in ds.with_stats():
        n, mean, std = stat(e, "numel"), stat(e, "mean"), stat(e, "std")
        if not n or mean is None or std is None:
            continue
        n_tot += int(n)
        s1 += n * mean
        # The capture stores the sample std (n - 1); the file's sum of squares needs n.
        s2 += (n - 1) * std * std + n * mean * mean
        lo = min(lo, stat(e, "min") if stat(e, "min") is not None else lo)
        hi = max(hi, stat(e, "max") if stat(e, "max") is not None else hi)
    if not n_tot:
        return {}
    mean = s1 / n_tot
    return {"numel": n_tot, "mean": mean, "std": math.sqrt(max(s2 / n_tot - mean * mean, 0.0)),
            "min": lo, "max": hi}


def _pie(ax, counts: Counter, title: str) -> None:
    items = counts.most_common()
    ax.pie([c for _, c in items], labels=[f"{k} ({c})" for k, c in items], autopct="%1.0f%%",
           textprops={"fontsize": 9})
    ax.set_title(title)


def write_quick(ds: "Dataset", catalog: Catalog, out: Path, fs: "FigureSet | None" = None) -> list[str]:
    """quick_analysis.png (values histogram, pies by quant type / layer type / pass) and tensor_stats.txt."""
    import matplotlib.pyplot as plt

    from tensor_viz.data import values
    from tensor_viz.figures import COUNT_AXIS, VALUE_AXIS, Figure, save_png

    out.mkdir(parents=True, exist_ok=True)
    entries = ds.entries
    written: list[str] = []
    v = values(ds.sampled())
    if entries:
        fig, axes = plt.subplots(2, 2, figsize=(12, 9.5))
        fig.subplots_adjust(hspace=0.35, wspace=0.3)
        ax = axes[0, 0]
        if v.size:
            ax.hist(v, bins=100)
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no values could be read", ha="center", transform=ax.transAxes)
        ax.set(title=f"all sampled values ({v.size:,} from {len(ds.sampled())} files)",
               xlabel=VALUE_AXIS, ylabel=COUNT_AXIS)
        _pie(axes[0, 1], Counter(e.name.quant_type for e in entries), "files by quant type")
        _pie(axes[1, 0], Counter(e.name.layer_type for e in entries), "files by layer type")
        _pie(axes[1, 1], Counter(e.name.operation for e in entries), "files by pass (operation)")
        title = f"Quick analysis: {len(entries)} tensors in {catalog.directory}"
        issues = save_png(fig, out / "quick_analysis.png", title, fs.dpi if fs else 90)
        written.append("quick_analysis.png")
        if fs is not None:
            fs.figures.append(Figure("quick", "quick_analysis.png", "Quick analysis",
                                     "Histogram of sampled values and how the captured files split "
                                     "by quant type, layer type and pass. Check that every pass and "
                                     "format you expected was captured.", layout_issues=issues))
    lines = [f"Tensor directory: {catalog.directory}", f"Tensors: {len(entries)}"]
    tot = overall_stats(ds)
    if tot:
        lines += [f"Values (all tensors, from stored statistics): {tot['numel']:,}",
                  f"Range: [{tot['min']:.6g}, {tot['max']:.6g}]",
                  f"Mean: {tot['mean']:.6g}", f"Std: {tot['std']:.6g}"]
    if v.size:
        lines.append(f"Sampled values for plots: {v.size:,} from {len(ds.sampled())} files (fixed seed)")
    for title, key in (("quant type", lambda e: e.name.quant_type), ("layer type", lambda e: e.name.layer_type),
                       ("operation", lambda e: e.name.operation)):
        c = Counter(key(e) for e in entries)
        lines.append(f"By {title}:")
        lines += [f"  {k}: {n} files ({100 * n / len(entries):.1f}%)" for k, n in c.most_common()]
    counts = catalog.problem_counts()
    lines.append(f"Problems: {sum(counts.values())}" + (" (" + ", ".join(f"{k} {n}" for k, n in
                                                                 sorted(counts.items())) + ")" if counts else ""))
    atomic_write_text(out / "tensor_stats.txt", "\n".join(lines) + "\n")
    written.append("tensor_stats.txt")
    return written
