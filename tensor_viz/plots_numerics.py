"""whatif_numerics/: what-if numerics over training, from the numbers capture stored per tensor
(tensor_viz.numerics_data's rows; numerics.csv holds them all).

Three figures: the SQNR timeline (one panel per what-if format, one line per layer x tensor,
coloured by phase x component group), the block-scale histograms (MX E8M0 exponent,
NVFP4 E4M3 block scale, summed over tensors, forward and backward apart) and SQNR grouped by
phase (pre/post) and component (FA/linear): the grouping users read captures by.
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from quant.whatif import SCALE_KIND_MX, SCALE_KIND_NVFP4
from tensor_viz import numerics_data as nd
from tensor_viz.data import Dataset
from tensor_viz.figures import FigureSet, grid, legend_below, legend_outside, too_few_iterations

SECTION = "whatif_numerics"
SQNR_AXIS = "SQNR (dB, higher is better)"
ITERATION_AXIS = "iteration (training step)"
BLOCKS_AXIS = "blocks (count, log)"
#: block-scale kind -> x-axis label of its histogram
SCALE_AXIS = {SCALE_KIND_MX: "E8M0 shared exponent (power of 2)",
              SCALE_KIND_NVFP4: "E4M3 block scale (log2 binade)"}
#: the phase x component groups -> colour; other groups (unknown phase/component) are grey
GROUP_COLOURS = dict(zip(nd.GROUP_ORDER, ("tab:blue", "tab:cyan", "tab:red", "tab:orange")))
OTHER_COLOUR = "tab:gray"


def group_name(g: tuple[str, str]) -> str:
    return f"{g[0]} {g[1]}"


def _group_of_key(table: list[nd.Row]) -> dict[str, tuple[str, str]]:
    mixed = len({r["quant_type"] for r in table}) > 1
    return {nd.row_key(r, mixed): (r["phase"], r["component"]) for r in table}


def _formats_with(table: list[nd.Row], numbers) -> list[str]:
    """The what-if formats for which ``numbers(table, fmt)`` (an aggregation of numerics_data)
    has something to draw."""
    return [f for f in nd.formats(table) if numbers(table, f)]


def _panels(fmts: list[str]):
    """One panel per format, three to a row (every figure of the section)."""
    return grid(len(fmts), ncols=min(3, len(fmts)), size=(5.2, 3.8))


def _format_figure(table: list[nd.Row], numbers):
    """(formats, figure, panels) of the formats ``numbers`` has something for; None: none has."""
    fmts = _formats_with(table, numbers)
    return (fmts, *_panels(fmts)) if fmts else None


def _iteration_labels(its: list) -> list[str]:
    return ["NA" if i is None else str(i) for i in its]


def draw_timeline(table: list[nd.Row], fs: FigureSet) -> bool:
    """SQNR per layer x tensor over iterations, one panel per what-if format; one line instead
    when too few iterations were captured for lines over them (the per-layer table of the
    summary and the phase x component boxes compare formats within an iteration)."""
    fmts = _formats_with(table, lambda t, f: nd.timeline(t, f)[0])
    if not fmts:
        return False
    few = too_few_iterations(nd.iterations(table), "the what-if SQNR timeline")
    if few:
        fs.skip(SECTION, "What-if SQNR over training", few + "; the summary's per-layer table "
                "names each format's lowest SQNR")
        return False
    groups = _group_of_key(table)
    fig, axes = _panels(fmts)
    worst_notes, exact = [], 0
    for ax, fmt in zip(axes, fmts):
        keys, its, cells = nd.timeline(table, fmt)
        x = np.arange(len(its))
        for k in keys:
            y = np.array([cells.get((k, i), np.nan) for i in its], dtype=float)
            exact += int(np.isinf(y).sum())
            y[~np.isfinite(y)] = np.nan
            ax.plot(x, y, "-o", ms=3, lw=0.9, alpha=0.7, label=k,
                    color=GROUP_COLOURS.get(groups.get(k), OTHER_COLOUR))
        last = [(cells[(k, its[-1])], k) for k in keys
                if math.isfinite(cells.get((k, its[-1]), math.nan))]
        if last:
            v, k = min(last)
            worst_notes.append(f"{fmt}: {k} ({v:.1f} dB)")
        step = max(1, len(its) // 8)
        ax.set_xticks(x[::step], _iteration_labels(its)[::step])
        ax.set_xlim(-0.5, len(its) - 0.5)
        ax.set(title=fmt, xlabel=ITERATION_AXIS, ylabel=SQNR_AXIS)
    present = {groups[k] for k in groups}
    handles = [plt.Line2D([], [], color=GROUP_COLOURS.get(g, OTHER_COLOUR), marker="o", label=group_name(g))
               for g in nd.GROUP_ORDER if g in present]
    if any(g not in GROUP_COLOURS for g in present):
        handles.append(plt.Line2D([], [], color=OTHER_COLOUR, marker="o", label="other"))
    legend_outside(axes[-1], handles=handles, fontsize=7, title="phase component",
                   title_fontsize=7)
    n_rows = len({k for f in fmts for k in nd.timeline(table, f)[0]})
    caption = (f"One line per layer and tensor ({n_rows} rows), the lowest SQNR over ranks and "
               "micro-batches at each captured iteration, quantized along the reduction axis of "
               "the GEMM the tensor feeds. A line that falls over training is a layer whose "
               "range drifts away from the format. Lowest at the last iteration: "
               + "; ".join(worst_notes) + ".")
    if exact:
        caption += f" {exact} points are exact (infinite SQNR) and not drawn."
    fs.save(fig, SECTION, "sqnr_timeline", "What-if SQNR over training, one panel per format", caption)
    return True


def draw_block_scales(table: list[nd.Row], fs: FigureSet) -> bool:
    """Histograms of the stored block scales of each block format, forward and backward apart."""
    drawn = _format_figure(table, nd.block_scale_hist)
    if drawn is None:
        return False
    fmts, fig, axes = drawn
    spans = []
    for ax, fmt in zip(axes, fmts):
        hists = nd.block_scale_hist(table, fmt, by="operation")
        kind = nd.scale_kind(table, fmt)
        width = 0.8 / len(hists)
        for j, (op, h) in enumerate(hists.items()):
            bins = np.array(list(h), dtype=float)
            ax.bar(bins - 0.4 + width * (j + 0.5), list(h.values()), width=width, label=str(op),
                   alpha=0.85)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # bins are integers
        ax.set(title=f"{fmt}", xlabel=SCALE_AXIS.get(kind, "block scale bin"), ylabel=BLOCKS_AXIS)
        legend_below(ax, fontsize=7, title="pass", title_fontsize=7)
        lo = min(min(h) for h in hists.values())
        hi = max(max(h) for h in hists.values())
        spans.append(f"{fmt} {lo}..{hi}")
    short_rows = nd.short_axis_count([r for r in table if r["format"] in fmts])
    caption = ("Every block of every tensor with what-if numerics, summed over layers and "
               "iterations. MX: the E8M0 shared exponent floor(log2 block amax) - emax of the "
               "element format; NVFP4: the binade floor(log2 s) of the E4M3 block scale. Blocks "
               "at the low end flush their small elements; a gap between passes shows gradients "
               "and activations need different scales. Ranges: " + ", ".join(spans) + ".")
    if short_rows:
        caption += (f" {short_rows} tensor x format rows have a block axis shorter than one block "
                    "(short_axis in numerics.csv): their blocks are zero-padded and counted here.")
    fs.save(fig, SECTION, "block_scale_hist", "Block-scale histograms per block format", caption)
    return True


def draw_phase_component(table: list[nd.Row], fs: FigureSet) -> bool:
    """SQNR grouped by phase (pre/post) and component (FA/linear), one panel per format."""
    drawn = _format_figure(table, nd.by_phase_component)
    if drawn is None:
        return False
    fmts, fig, axes = drawn
    for ax, fmt in zip(axes, fmts):
        groups = nd.by_phase_component(table, fmt)
        ax.boxplot(list(groups.values()), showfliers=True, flierprops={"markersize": 3},
                   medianprops={"gid": "median"})
        ax.set_xticks(range(1, len(groups) + 1),
                      [f"{group_name(g)}\n(n={len(v)})" for g, v in groups.items()], fontsize=8)
        ax.set(title=fmt, xlabel="phase / component", ylabel=SQNR_AXIS)
    fs.save(fig, SECTION, "sqnr_by_phase_component",
            "What-if SQNR by phase (pre/post) and component (FA/linear)",
            "The seed's grouping of captured tensors: pre = a layer's inputs, post = its outputs; "
            "FA = attention core, linear = linear layers. One box per group over every tensor, "
            "iteration and rank (n = tensor records); the group with the lowest box is the one a "
            "format hurts most.")
    return True


def draw_numerics(ds: Dataset, fs: FigureSet) -> None:
    """The section: timeline, block-scale histograms, phase x component grouping."""
    table = ds.numerics
    drew = [draw(table, fs) for draw in (draw_timeline, draw_block_scales, draw_phase_component)]
    if not any(drew):
        fs.placeholder(SECTION, "no what-if numerics were stored (capture with whatif_formats: "
                                "default, or TENSOR_SAVE_WHATIF_FORMATS=default) and no saved "
                                "high-precision tensor could be recomputed")
