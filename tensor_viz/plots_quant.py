"""quantization_analysis/ (measured and what-if quantization error) and numerics_map/
(a layer x tensor heatmap of one statistic over iterations)."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np

from tensor_capture import schema
from tensor_viz import numerics_data
from tensor_viz.data import Dataset, group, ratio, stat
from tensor_viz.figures import FigureSet, Subset, colorbar, paginate, short, too_few_iterations
from tensor_viz.options import DEFAULT_MAP_STATS, MAP_STAT_NAMES

MAX_ROWS = 60     # rows per numerics-map / what-if figure; more rows go on further parts
#: How pipeline.load picks the tensors it recomputes what-if numbers for (said under partial
#: figures): numbers capture stored are always shown
WHATIF_CHOICE = ("the numbers capture stored, plus those recomputed for files read for values (a seeded "
                 "round-robin over quant type, layer type, pass and tensor), up to --whatif-files")

# statistic name -> (how to read it from an entry, transform, colorbar label)
MAP_STATS = {
    "absmax": (lambda e: stat(e, "absmax"), lambda v: math.log2(v) if v and v > 0 else np.nan,
               "log2 absmax (binade)"),
    "std": (lambda e: stat(e, "std"), lambda v: math.log2(v) if v and v > 0 else np.nan, "log2 std (binade)"),
    "overflow_ratio": (lambda e: ratio(e, "overflow_ratio"), lambda v: 100 * v, "overflow (% of elements)"),
    "underflow_ratio": (lambda e: ratio(e, "underflow_ratio"), lambda v: 100 * v, "underflow (% of elements)"),
    "flush_to_zero_ratio": (lambda e: ratio(e, "flush_to_zero_ratio"), lambda v: 100 * v,
                            "flush to zero (% of elements)"),
}

assert tuple(MAP_STATS) == MAP_STAT_NAMES


def numerics_matrix(ds: Dataset, stat_name: str) -> tuple[list[str], list[str], np.ndarray]:
    """Rows (layer x tensor), columns (iterations), values (max over ranks and samples)."""
    read, transform, _ = MAP_STATS[stat_name]
    mixed = len({e.name.quant_type for e in ds.entries}) > 1
    cells: dict[tuple[str, str], float] = {}
    for e in ds.entries:
        v = read(e)
        if v is None:
            continue
        row = e.label + (f" [{e.name.quant_type}]" if mixed else "")
        col = "NA" if e.name.iteration is None else str(e.name.iteration)
        t = transform(v)
        if np.isfinite(t):
            cells[(row, col)] = max(cells.get((row, col), -np.inf), t)
    rows = sorted({r for r, _ in cells})
    cols = sorted({c for _, c in cells}, key=lambda c: (c == "NA", int(c) if c.isdigit() else 0))
    m = np.full((len(rows), len(cols)), np.nan)
    ri = {r: i for i, r in enumerate(rows)}
    ci = {c: i for i, c in enumerate(cols)}
    for (r, c), v in cells.items():
        m[ri[r], ci[c]] = v
    return rows, cols, m


MAX_PARTS = 4
MAP_CAPTION = ("One row per layer and tensor, one column per iteration. Look for rows that brighten "
               "over time (growing range or overflow) and for the first iteration where a row changes: "
               "that layer is where the numerics went wrong.")


def _map_part(fs: FigureSet, name: str, suffix: str, rows: list[str], cols: list[str], m: np.ndarray,
              vlim: tuple[float, float], subset: Subset | None) -> None:
    """One figure of the map: a heatmap, rows = layer x tensor, columns = iterations."""
    label = MAP_STATS[name][2]
    height = 1.5 + 0.22 * len(rows)
    fig, ax = plt.subplots(figsize=(min(18, 3 + 0.5 * len(cols)) + 4, height))
    im = ax.imshow(np.ma.masked_invalid(m), aspect="auto", cmap="magma", interpolation="nearest",
                   vmin=vlim[0], vmax=vlim[1])
    colorbar(fig, im, ax, label)
    ax.grid(False)
    ax.set_yticks(range(len(rows)), [short(r, 48) for r in rows], fontsize=8)
    step = max(1, len(cols) // 20)
    ax.set_xticks(range(0, len(cols), step), cols[::step])
    ax.set(xlabel="iteration (training step)", ylabel="layer / pass / tensor")
    fs.save(fig, "numerics_map", f"map_{name}{suffix}", f"Numerics map: {name} per tensor over iterations",
            MAP_CAPTION, subset)


def draw_numerics_map(ds: Dataset, fs: FigureSet, stats: tuple[str, ...] = DEFAULT_MAP_STATS) -> None:
    """The map of each statistic over iterations; one line instead when too few iterations were
    captured for a map over them, and one line for a statistic that is zero in every cell."""
    section = "numerics_map"
    its = sorted({e.name.iteration for e in ds.with_stats()}, key=lambda i: (i is None, i or 0))
    few = too_few_iterations(its, "a map over iterations")
    if few:
        fs.placeholder(section, f"{few}; the statistics/ and overflow_analysis/ figures and the "
                                "summary's tables compare the tensors of one iteration")
        return
    drew = False
    for name in stats:
        rows, cols, m = numerics_matrix(ds, name)
        if not rows:
            continue
        drew = True
        if name.endswith("_ratio") and not np.any(m[np.isfinite(m)]):    # a ratio that is 0 everywhere
            fs.skip(section, f"Numerics map: {name}",
                    f"{name} is 0 in every one of the {len(rows)} layer x tensor rows at each of the "
                    f"{len(cols)} iterations, so no map is drawn")
            continue
        vlim = float(np.nanmin(m)), float(np.nanmax(m))   # one colour scale for all parts
        shown = rows[:MAX_PARTS * MAX_ROWS]
        for suffix, part, note in paginate(shown, MAX_ROWS, "rows"):
            lo = shown.index(part[0])
            if len(shown) < len(rows):   # pages cover only the first MAX_PARTS * MAX_ROWS rows
                note = Subset(len(part), len(rows), "rows",
                              f"the first {len(shown)} rows in name order are drawn over {MAX_PARTS} parts; "
                              "choose layers at capture time to see the rest", first=lo + 1)
            _map_part(fs, name, suffix.replace("_page", "_part"), part, cols, m[lo:lo + len(part)], vlim, note)
    if not drew:
        fs.placeholder(section, "no stored statistics to map")


def whatif_candidates(ds: Dataset) -> int:
    """Tensors (label x quant type) that could have a what-if row: the high-precision ones
    saved to a file or with numbers capture stored."""
    return len({(e.label, e.name.quant_type) for e in ds.entries
                if e.variant != schema.VARIANT_QUANTIZED
                and (e.path or numerics_data.captured(e.meta) is not None)})


def draw_quantization(ds: Dataset, fs: FigureSet) -> None:
    section = "quantization_analysis"
    drew = False
    if ds.pairs:
        by_layer = group(ds.pairs, lambda p: p.hp.layer_label)
        keys = list(by_layer)
        fig, axes = plt.subplots(1, 2, figsize=(max(9, 0.6 * len(keys) + 5), 4.6))
        axes[0].bar(keys, [100 * max(p.errors["relative_error"] for p in by_layer[k]) for k in keys])
        axes[0].set(title="worst relative error", xlabel="layer", ylabel="relative error (%)")
        axes[1].bar(keys, [min(p.errors["sqnr"] for p in by_layer[k]) for k in keys])
        axes[1].set(title="worst SQNR", xlabel="layer", ylabel="SQNR (dB)")
        for ax in axes:
            ax.tick_params(axis="x", rotation=45)
        fs.save(fig, section, "measured_error_per_layer",
                "Measured quantization error: saved quantized operand vs high precision",
                "Both operands of the same GEMM were saved. Layers with a high relative error (low "
                "SQNR) are where the format loses the most information; compare across formats.")
        drew = True
    wf = [r for r in ds.numerics if r.get("sqnr_db") is not None]
    if wf:
        fmts = numerics_data.formats(wf)
        rows = group(wf, lambda r: f"{r['label']} [{r['quant_type']}]")
        keys = list(rows)
        m = np.full((len(keys), len(fmts)), np.nan)
        for i, k in enumerate(keys):
            for j, f in enumerate(fmts):
                finite = [r["sqnr_db"] for r in rows[k] if r["format"] == f and np.isfinite(r["sqnr_db"])]
                if finite:
                    m[i, j] = min(finite)
        recomputed = sum(1 for r in wf if r["source"] == numerics_data.SOURCE_RECOMPUTED)
        origin = (" Numbers as capture stored them, along the reduction axis of the GEMM each tensor "
                  "feeds" + (f"; {recomputed} of {len(wf)} (tensor, format) numbers were recomputed "
                             "from saved tensors on the same axis (source 'recomputed' in "
                             "numerics.csv)." if recomputed else "."))
        candidates = whatif_candidates(ds)
        computed = Subset(len(keys), candidates, "tensors", WHATIF_CHOICE)
        if fmts:
            vlim = float(np.nanmin(m)), float(np.nanmax(m))
            for suffix, page, note in paginate(keys, MAX_ROWS, "rows"):
                lo = keys.index(page[0])
                fig, ax = plt.subplots(figsize=(3 + 0.8 * len(fmts) + 4, 1.6 + 0.24 * len(page)))
                im = ax.imshow(np.ma.masked_invalid(m[lo:lo + len(page)]), aspect="auto", cmap="viridis",
                               interpolation="nearest", vmin=vlim[0], vmax=vlim[1])
                colorbar(fig, im, ax, "SQNR (dB, higher is better)")
                ax.grid(False)
                ax.set_xticks(range(len(fmts)), fmts, rotation=45, ha="right")
                ax.set_yticks(range(len(page)), [short(k, 48) for k in page], fontsize=8)
                ax.set(xlabel="format (what-if)", ylabel="layer / pass / tensor [captured under]")
                fs.save(fig, section, "whatif_sqnr" + suffix, "What-if: SQNR of each format on the same tensors",
                        "Each captured high-precision tensor quantized to every format with quant/. Dark "
                        "cells are layer/format combinations that lose the most; a column uniformly "
                        "brighter than yours is a safer format for this model." + origin
                        + (f" What-if errors exist for {computed.note()}." if computed.short() else ""),
                        note or (computed if computed.short() else None))
            fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(fmts) + 3), 4.5))
            med = [np.nanmedian([r["rel_error"] * 100 for r in wf
                                 if r["format"] == f and r["rel_error"] is not None] or [np.nan])
                   for f in fmts]
            ax.bar(fmts, med)
            ax.set_yscale("log")
            ax.tick_params(axis="x", rotation=45)
            ax.set(xlabel="format (what-if)", ylabel="median relative error (%, log)")
            fs.save(fig, section, "whatif_relative_error", "What-if: median relative error per format",
                    "One number per format over every tensor with what-if errors; lower is better."
                    + origin,
                    computed if computed.short() else None)
            drew = True
    if not drew:
        reason = ds.notes.get(section) or ("no high-precision/quantized operand pairs were saved and "
                                          "no what-if formats were computed")
        fs.placeholder(section, reason)
