"""The interactive part of index.html: the numerics map and the what-if SQNR timeline as inline
SVG, where hovering a cell or a point shows its layer, tensor, iteration and value.

Why SVG with ``<title>`` and no script: the page must open from disk, with no server, no
network and no code to trust; every browser shows an SVG element's ``<title>`` as its tooltip and
CSS ``:hover`` highlights it. Every text goes through markupsafe's escaping, so a tensor name can
never become markup. The numbers come from the same functions as the PNG figures
(plots_quant.numerics_matrix, numerics_data.timeline).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from markupsafe import Markup, escape

from tensor_viz import numerics_data as nd
from tensor_viz.data import Dataset
from tensor_viz.figures import subset_note, too_few_iterations

MAX_ROWS = 240          # rows of one chart (the map's MAX_PARTS * MAX_ROWS)
MAX_ITERATIONS = 200    # columns of one chart: evenly spaced, first and last kept
MAX_CELLS = 6000        # cells (points) of one chart: fewer columns for many rows, so the page
                        # stays a few MB at most (about 130 bytes per cell with its tooltip)
LABEL_W, CELL_H, PLOT_W = 300, 12, 720
#: viridis-like stops (low -> high), interpolated in RGB
_STOPS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


@dataclass
class Chart:
    """One interactive chart: what it shows, its SVG, and a note when it shows part of the data."""

    kind: str          # "map" or "timeline"
    title: str
    svg: Markup
    note: str = ""
    open: bool = False  # shown unfolded (the first chart of each kind)


def colour(t: float) -> str:
    """Hex colour of ``t`` in [0, 1] on the viridis-like scale."""
    t = min(1.0, max(0.0, t)) * (len(_STOPS) - 1)
    i = min(int(t), len(_STOPS) - 2)
    f = t - i
    r, g, b = (round(a + (c - a) * f) for a, c in zip(_STOPS[i], _STOPS[i + 1]))
    return f"#{r:02x}{g:02x}{b:02x}"


def columns(n_rows: int, n_cols: int) -> list[int]:
    """The columns a chart of ``n_rows`` rows keeps (``MAX_ITERATIONS``, ``MAX_CELLS``)."""
    return pick(n_cols, min(MAX_ITERATIONS, max(2, MAX_CELLS // max(1, n_rows))))


def pick(n: int, limit: int) -> list[int]:
    """Indexes of at most ``limit`` of ``n`` items, evenly spaced, first and last kept."""
    if n <= limit:
        return list(range(n))
    if limit < 2:
        return [n - 1]
    return sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})


def tip(row: str, iteration: Any, what: str, value: str) -> str:
    """The hover text of one cell or point (one definition, tests read it back)."""
    return f"{row} | iteration {iteration} | {what}: {value}"


def _fmt(v: float) -> str:
    if v == math.inf:
        return "exact (inf)"
    return f"{v:.4g}"


def heatmap_svg(rows: Sequence[str], cols: Sequence[Any], m: np.ndarray, what: str) -> Markup:
    """Rows x columns of coloured cells, each with its hover text; NaN cells are left empty."""
    finite = m[np.isfinite(m)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    cw = max(4, min(24, PLOT_W // max(1, len(cols))))
    width = max(LABEL_W + cw * len(cols) + 90, LABEL_W + 6 * (40 + len(what)))
    height = max(CELL_H * len(rows), 110) + 40
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' class=ivmap width={width} height={height} "
           f"role=img aria-label='{escape(what)}'>"]
    for i, r in enumerate(rows):
        y = 20 + i * CELL_H
        out.append(f"<text x={LABEL_W - 4} y={y + CELL_H - 2} text-anchor=end>{escape(r)}</text>")
        for j, c in enumerate(cols):
            v = m[i, j]
            if not np.isfinite(v):
                continue
            t = (v - lo) / (hi - lo) if hi > lo else 0.5
            out.append(f"<rect x={LABEL_W + j * cw} y={y} width={cw} height={CELL_H} "
                       f"fill='{colour(t)}'><title>{escape(tip(r, c, what, _fmt(float(v))))}</title></rect>")
    step = max(1, len(cols) // 10)
    for j in range(0, len(cols), step):
        out.append(f"<text x={LABEL_W + j * cw} y=14>{escape(str(cols[j]))}</text>")
    x = LABEL_W + cw * len(cols) + 10
    out.append(f"<text x={x + 16} y=48>{escape(f'{hi:.3g}')}</text>")
    out.append(f"<text x={x + 16} y=120>{escape(f'{lo:.3g}')}</text>")
    out.append(f"<text x={LABEL_W} y={height - 6}>columns: iteration (training step); colour: "
               f"{escape(what)}</text>")
    for k in range(10):
        out.append(f"<rect x={x} y={40 + k * 8} width=12 height=8 fill='{colour(1 - k / 9)}' />")
    out.append("</svg>")
    return Markup("".join(out))


def timeline_svg(keys: Sequence[str], its: Sequence[Any], cells: dict, fmt: str) -> Markup:
    """SQNR over iterations: one polyline per layer x tensor, one point per iteration."""
    vals = [v for v in cells.values() if math.isfinite(v)]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    left, top, w, h = 60, 16, PLOT_W, 300

    def xy(j: int, v: float) -> tuple[float, float]:
        x = left + (w * j / (len(its) - 1) if len(its) > 1 else w / 2)
        return round(x, 1), round(top + h * (hi - v) / (hi - lo), 1)

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' class=ivline width={left + w + 20} "
           f"height={top + h + 50} role=img aria-label='{escape(fmt)} SQNR over iterations'>",
           f"<rect class=frame x={left} y={top} width={w} height={h} />"]
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        out.append(f"<text x={left - 4} y={xy(0, v)[1] + 4} text-anchor=end>{v:.1f}</text>")
    step = max(1, len(its) // 10)
    for j in range(0, len(its), step):
        out.append(f"<text x={xy(j, lo)[0]} y={top + h + 16} text-anchor=middle>"
                   f"{escape(str(its[j]))}</text>")
    out.append(f"<text x={left + w / 2} y={top + h + 36} text-anchor=middle>iteration (training "
               "step)</text>")
    out.append(f"<text x=12 y={top + h / 2} transform='rotate(-90 12 {top + h / 2})' "
               "text-anchor=middle>SQNR (dB)</text>")
    for i, key in enumerate(keys):
        pts = [(j, cells[(key, it)]) for j, it in enumerate(its)
               if math.isfinite(cells.get((key, it), math.nan))]
        if not pts:
            continue
        hue = colour(i / max(1, len(keys) - 1))
        line = " ".join(f"{x},{y}" for x, y in (xy(j, v) for j, v in pts))
        out.append(f"<g class=series stroke='{hue}' fill='{hue}'><title>{escape(key)}</title>"
                   f"<polyline points='{line}' />")
        for j, v in pts:
            x, y = xy(j, v)
            text = tip(key, its[j], f"{fmt} SQNR", f"{v:.2f} dB")
            out.append(f"<circle cx={x} cy={y} r=3.5><title>{escape(text)}</title></circle>")
        out.append("</g>")
    out.append("</svg>")
    return Markup("".join(out))


def _note(shown: int, total: int, what: str, how: str) -> str:
    return subset_note(shown, total, what, how)


def map_charts(ds: Dataset, stats: Sequence[str]) -> list[Chart]:
    """The numerics map of each statistic (plots_quant's matrix, its transform and label)."""
    from tensor_viz.plots_quant import MAP_STATS, numerics_matrix

    charts = []
    for name in stats:
        rows, cols, m = numerics_matrix(ds, name)
        if not rows or (name.endswith("_ratio") and not np.any(np.nan_to_num(m))):
            continue          # a ratio that is 0 everywhere: numerics_map/ says so in one line
        ri = list(range(min(len(rows), MAX_ROWS)))
        ci = columns(len(ri), len(cols))
        note = "; ".join(n for n in (
            _note(len(ri), len(rows), "rows", "the first in name order"),
            _note(len(ci), len(cols), "iterations", "evenly spaced, first and last kept")) if n)
        svg = heatmap_svg([rows[i] for i in ri], [cols[j] for j in ci], m[np.ix_(ri, ci)],
                          MAP_STATS[name][2])
        charts.append(Chart("map", f"Numerics map: {name}", svg, note))
    return charts


def timeline_charts(ds: Dataset) -> list[Chart]:
    """The what-if SQNR timeline of each format (numerics_data.timeline)."""
    charts = []
    for fmt in nd.formats(ds.numerics):
        keys, its, cells = nd.timeline(ds.numerics, fmt)
        if not keys:
            continue
        ki = keys[:MAX_ROWS]
        ci = [its[j] for j in columns(len(ki), len(its))]
        note = "; ".join(n for n in (
            _note(len(ki), len(keys), "rows", "the first in name order"),
            _note(len(ci), len(its), "iterations", "evenly spaced, first and last kept")) if n)
        charts.append(Chart("timeline", f"What-if SQNR over training: {fmt}",
                            timeline_svg(ki, ci, cells, fmt), note))
    return charts


def skipped(ds: Dataset) -> str:
    """'' when the charts (both over iterations) are drawn, else the one line saying why not:
    fewer than figures.MIN_ITERATIONS captured iterations."""
    its = sorted({e.name.iteration for e in ds.entries}, key=lambda i: (i is None, i or 0))
    return too_few_iterations(its, "the interactive map and timeline (over iterations)")


def charts(ds: Dataset, map_stats: Sequence[str]) -> list[Chart]:
    """Every interactive chart of the page: the maps, then the timelines; the first of each
    kind unfolded. None when ``skipped`` says why."""
    if skipped(ds):
        return []
    out = []
    for group in (map_charts(ds, map_stats), timeline_charts(ds)):
        if group:
            group[0].open = True
        out += group
    return out
