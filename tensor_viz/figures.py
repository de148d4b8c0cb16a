"""Saving figures: one PNG per figure, closed at once, with a title and a caption.

Every section folder gets at least one file: a real figure, or a placeholder image that
says why there is nothing to draw (the index lists it as a note).

``save_png`` is the one way a report figure reaches disk: it places the title just above the
panels, gives log axes readable ticks, thins numeric tick labels that would overlap, and then
checks the result (``layout_problems``: title, axis labels, no colliding text), so every figure
of the report, the quick view included, gets the same treatment and the same check.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence, TypeVar

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.category import StrCategoryFormatter
from matplotlib.patches import Wedge
from matplotlib.ticker import FixedFormatter, FixedLocator, FuncFormatter, LogLocator, NullLocator
from matplotlib.transforms import Bbox

from lowp_common import atomic_path, atomic_write_text

# Linear axes switch to an offset exponent (x 10^-3) below 0.01 and from 10^4 on, so the tick
# labels of small gradients stay short instead of "-0.0010 -0.0005 ..." running into each other.
plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "figure.titlesize": 13,
                     "axes.grid": True, "grid.alpha": 0.3,
                     "axes.formatter.limits": (-2, 4), "axes.formatter.use_mathtext": True})

#: Captured values are plain numbers (activations, weights, gradients carry no physical unit):
#: the axes say so, and which scale, instead of an unnamed "tensor unit".
UNITLESS = "dimensionless"
VALUE_AXIS = f"value ({UNITLESS})"
ABS_VALUE_AXIS = f"|value| ({UNITLESS}, log scale)"
COUNT_AXIS = "count (values)"
FILES_AXIS = "count (files)"
DENSITY_AXIS = "density (per unit of value)"
LOG2_AXIS = "log2 |value| (binade)"
PERCENT_AXIS = "ratio (% of elements)"
#: what a section with nothing to draw holds instead of figures: the reason, one line
NO_DATA = "no_data.txt"
#: Plots over iterations need this many captured iterations: with one a line over iterations
#: is a column of dots, with two a trend is a straight line between two points.
MIN_ITERATIONS = 3

T = TypeVar("T")


@dataclass(frozen=True)
class Subset:
    """What part of the data a figure or table shows, so a cut is never silent.

    ``first`` (1-based) marks one page of a paginated figure: all items are drawn, over pages."""

    shown: int
    total: int
    what: str                 # plural noun: "groups", "tensors", "rows"
    chosen_by: str = ""       # how the shown items were picked
    first: int | None = None  # page of a paginated figure: items first..first+shown-1

    @property
    def complete(self) -> bool:
        return self.first is None and self.shown >= self.total

    def short(self) -> str:
        """For titles: '12 of 19 groups', 'groups 13-19 of 19'; '' when everything is shown."""
        if self.complete:
            return ""
        if self.first is not None:
            return f"{self.what} {self.first}-{self.first + self.shown - 1} of {self.total}"
        return f"{self.shown} of {self.total} {self.what}"

    def note(self) -> str:
        """For captions and tables: the short form plus how the items were chosen."""
        text = self.short()
        return f"{text}, {self.chosen_by}" if text and self.chosen_by else text


def too_few_iterations(iterations: Sequence, what: str) -> str:
    """'' when a plot over ``iterations`` (the captured ones it would show) has enough of them
    (``MIN_ITERATIONS``), else the one line that says why ``what`` is left out."""
    if len(iterations) >= MIN_ITERATIONS:
        return ""
    named = ", ".join("NA" if i is None else str(i) for i in iterations) or "none"
    return (f"{what} needs at least {MIN_ITERATIONS} captured iterations; this capture has "
            f"{len(iterations)} (iteration {named})")


def subset_note(shown: int, total: int, what: str, chosen_by: str = "") -> str:
    """'48 of 79 tensors, chosen by ...' ('' when all ``total`` are shown): the one formatter of
    subset notes, for text outside figures (index.html tables)."""
    return Subset(shown, total, what, chosen_by).note()


def paginate(items: Sequence[T], per_page: int, what: str) -> Iterator[tuple[str, list[T], Subset | None]]:
    """(name suffix, items, page note) for every page, so a long list is drawn in full."""
    n_pages = max(1, -(-len(items) // per_page))
    for page in range(n_pages):
        chunk = list(items[page * per_page:(page + 1) * per_page])
        if n_pages == 1:
            yield "", chunk, None
        else:
            yield (f"_page{page + 1}", chunk,
                   Subset(len(chunk), len(items), what, f"page {page + 1} of {n_pages}; every one "
                          f"of the {len(items)} {what} is drawn over the {n_pages} pages",
                          first=page * per_page + 1))


@dataclass
class Figure:
    section: str
    path: str            # relative to the output directory, '/' separated
    title: str
    caption: str
    placeholder: bool = False
    subset: str = ""     # Subset.note() when the figure shows part of the data
    layout_issues: list[str] = field(default_factory=list)   # layout_problems() of the saved figure


@dataclass
class FigureSet:
    out_dir: Path
    dpi: int = 90
    figures: list[Figure] = field(default_factory=list)

    def start_section(self, section: str) -> None:
        """Empty OUT/section of the PNGs a previous run drew, so the folder matches this run."""
        folder = self.out_dir / section
        if folder.is_dir():
            for old in [*folder.glob("*.png"), *folder.glob(NO_DATA)]:
                old.unlink()

    def save(self, fig: "plt.Figure", section: str, name: str, title: str, caption: str,
             subset: Subset | None = None) -> Figure:
        """Write ``fig`` to OUT/section/name.png through ``save_png``; a partial view says so in
        its title and caption (``subset``)."""
        note = subset.note() if subset else ""
        if subset and subset.short():
            title = f"{title} ({subset.short()})"
            caption = f"{caption} Shown: {note}."
        issues = save_png(fig, self.out_dir / section / f"{name}.png", title, self.dpi)
        record = Figure(section, f"{section}/{name}.png", title, caption, subset=note,
                        layout_issues=issues)
        self.figures.append(record)
        return record

    def placeholder(self, section: str, reason: str) -> Figure:
        """Nothing to draw in ``section``. No image (a box saying "nothing to draw" costs the
        reader a screen and says one sentence): the reason goes to OUT/section/no_data.txt, so
        the folder still says why it is empty, and the report lists the section under "Not
        drawn"."""
        folder = self.out_dir / section
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / NO_DATA, f"{section}: nothing to draw: {reason}\n")
        return self.skip(section, f"{section}: nothing to draw", reason, path=f"{section}/{NO_DATA}")

    def skip(self, section: str, title: str, reason: str, path: str = "") -> Figure:
        """A figure left out on purpose (plots over iterations of a capture of one iteration, a
        map whose every cell is zero): one line in its section and in the report's "Not drawn"
        list instead of an image that shows nothing."""
        record = Figure(section, path, title, reason, placeholder=True)
        self.figures.append(record)
        return record

    def drawn(self) -> int:
        return sum(1 for f in self.figures if not f.placeholder)

    def in_section(self, section: str) -> list[Figure]:
        return [f for f in self.figures if f.section == section]


def grid(n: int, ncols: int = 3, size: tuple[float, float] = (4.6, 3.4), wspace: float = 0.35):
    """A figure with ``n`` axes in rows of ``ncols``; unused axes are hidden."""
    ncols = max(1, min(ncols, n))
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)
    height = size[1] * nrows
    fig.subplots_adjust(hspace=0.55, wspace=wspace, top=1 - 0.75 / height, bottom=0.45 / height)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.axis("off")
    return fig, flat[:n]


def colorbar(fig: "plt.Figure", mappable, ax, label: str):
    """A colourbar with plain '%.3g' tick labels: no offset exponent above the bar, where it
    would run into the panel's title."""
    return fig.colorbar(mappable, ax=ax, label=label, format="%.3g")


#: Groups whose typical magnitudes (75th percentile of |x|) differ by more than this factor
#: are drawn as |x| on a log axis: on a linear axis the small ones (gradients) are flat lines.
LOG_BOX_SPREAD = 100.0


def magnitude_spread(data: Sequence[np.ndarray]) -> float:
    """Ratio of the largest to the smallest typical magnitude (75th percentile of |x|) of the
    groups: above ``LOG_BOX_SPREAD`` one linear value axis cannot show them all."""
    scales = [float(np.percentile(np.abs(v), 75)) for v in data if v.size]
    scales = [x for x in scales if x > 0]
    return max(scales) / min(scales) if scales else 1.0


def value_boxes(ax, data: Sequence[np.ndarray]) -> str:
    """Box plots of value groups on the scale that shows every box, with its axis label.

    Linear values when the groups' magnitudes are within ``LOG_BOX_SPREAD`` of each other,
    else |value| on a log axis (zeros have no log and are left out). Returns a caption
    sentence that says which scale was used and why."""
    finite = [v[np.isfinite(v)] for v in data]
    spread = magnitude_spread(finite)
    if spread <= LOG_BOX_SPREAD:
        ax.boxplot([v if v.size else [np.nan] for v in finite], showfliers=False)
        ax.set_ylabel(VALUE_AXIS)
        return "Values on a linear axis."
    mags = [np.abs(v[v != 0]) for v in finite]
    zeros = sum(int((v == 0).sum()) for v in finite)
    total = sum(v.size for v in finite)
    ax.boxplot([m if m.size else [np.nan] for m in mags], showfliers=False)
    ax.set_yscale("log")
    ax.set_ylabel(ABS_VALUE_AXIS)
    return (f"Magnitudes |value| on a log axis, because the groups' typical magnitudes differ by "
            f"{spread:.2g}x (more than {LOG_BOX_SPREAD:g}x: on a linear axis the small groups would be "
            f"flat lines); the sign is not shown and exact zeros ({zeros:,} of {total:,} values) are left out.")


def stat_boxes(ax, data: Sequence[Sequence[float]], what: str) -> None:
    """Box plots of a per-file statistic (signed: mean, min, max; or positive: std) on an axis
    that shows every box: linear when the magnitudes stay within ``LOG_BOX_SPREAD``, else log
    (all positive) or symlog (signed; linear within the 5th percentile of |x|), labelled so."""
    arrays = [np.asarray([v for v in d if np.isfinite(v)], dtype=np.float64) for d in data]
    ax.boxplot([a if a.size else [np.nan] for a in arrays])
    mags = np.abs(np.concatenate([a for a in arrays if a.size] or [np.zeros(0)]))
    mags = mags[mags > 0]
    if mags.size < 2 or mags.max() / mags.min() <= LOG_BOX_SPREAD:
        ax.set_ylabel(f"{what} ({UNITLESS})")
    elif all((a > 0).all() for a in arrays):
        ax.set_yscale("log")
        ax.set_ylabel(f"{what} ({UNITLESS}, log scale)")
    else:
        ax.set_yscale("symlog", linthresh=float(np.percentile(mags, 5)))
        ax.set_ylabel(f"{what} ({UNITLESS}, symlog scale)")


def legend_outside(ax, **kwargs):
    """The panel's legend right of its data area, top-aligned: a legend inside a panel hides
    the lines it names whenever they fill the panel (``layout_problems`` reports that)."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **kwargs)


def legend_below(ax, **kwargs):
    """The panel's legend under its x label: for a panel with a neighbour on its right, where a
    legend at the side would run into the neighbour's labels."""
    n = len(ax.get_legend_handles_labels()[1])
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(3, max(1, n)),
                     borderaxespad=0.0, **kwargs)


def short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def overlay_density(fs: FigureSet, section: str, name: str, series: dict, title: str, caption: str,
                    xlabel: str = VALUE_AXIS) -> Figure | None:
    """One figure of step-histogram densities (log y), one curve per labelled array."""
    series = {k: v for k, v in series.items() if len(v)}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, v in series.items():
        ax.hist(v, bins=80, histtype="step", density=True, label=label)
    ax.set_yscale("log")
    legend_outside(ax)
    ax.set(xlabel=xlabel, ylabel=DENSITY_AXIS)
    return fs.save(fig, section, name, title, caption)


# ---------------------------------------------------------------- saving, tidying, checking

def save_png(fig: "plt.Figure", path: Path, title: str, dpi: int = 90) -> list[str]:
    """Title ``fig``, tidy its layout, write it to ``path`` atomically and close it.

    Returns ``layout_problems`` of the figure as written (empty when it is clean); the report
    keeps them on its Figure records and the tests require them empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.set_dpi(dpi)
        fig.suptitle(title)
        tight = tidy(fig)
        issues = layout_problems(fig, drawn=True)
        # The layout is drawn already: hand savefig the tight box (what bbox_inches="tight"
        # computes with one more layout pass) so it only renders.
        box = "tight" if tight is None else \
            tight.transformed(fig.dpi_scale_trans.inverted()).padded(plt.rcParams["savefig.pad_inches"])
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=dpi, bbox_inches=box)
    finally:
        plt.close(fig)
    return issues


MIN_LOG_TICKS = 3      # fewer labelled ticks than this on a log axis: label 1-2-5 steps too


def _log_tick(value: float, _pos=None) -> str:
    """Label of a 1-2-5 tick on a log axis: plain numbers near 1, m x 10^e further out."""
    if value <= 0:
        return ""
    exp = math.floor(math.log10(value) + 1e-9)
    mant = value / 10.0 ** exp
    if -2 <= exp <= 3:
        return f"{value:g}"
    return f"$10^{{{exp}}}$" if abs(mant - 1) < 1e-6 else f"${mant:.0f}\\times10^{{{exp}}}$"


def _ticks_in_view(axis) -> list:
    """The tick labels an axis draws: inside the view interval, visible, with text."""
    locs = axis.get_majorticklocs()
    lo, hi = sorted(axis.get_view_interval())
    span = (hi - lo) * 1e-9
    return [t.label1 for loc, t in zip(locs, axis.get_major_ticks(len(locs)))
            if lo - span <= loc <= hi + span and t.label1.get_visible() and t.label1.get_text()]


def _collide(a, b, slack: float = -1.0) -> bool:
    """Two window extents come closer than ``-slack`` pixels (touching text reads as one word)."""
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > slack) and (min(a.y1, b.y1) - max(a.y0, b.y0) > slack)


def _tick_overlaps(labels, renderer) -> int:
    """Neighbouring tick labels that overlap. Rotated labels are parallel strips one line high:
    they overlap when their centre lines are closer than a line height (their axis-aligned
    boxes always overlap, so boxes cannot tell)."""
    boxes = [t.get_window_extent(renderer) for t in labels]
    hits = 0
    for t, a, b in zip(labels, boxes, boxes[1:]):
        angle = math.radians(t.get_rotation() % 180)
        if abs(math.sin(angle)) < 1e-3:
            hits += _collide(a, b)
            continue
        dx, dy = (b.x0 + b.x1 - a.x0 - a.x1) / 2, (b.y0 + b.y1 - a.y0 - a.y1) / 2
        apart = abs(-dx * math.sin(angle) + dy * math.cos(angle))
        hits += apart < 0.9 * renderer.points_to_pixels(t.get_fontsize())
    return hits


def _axes_scales(ax):
    return ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale()))


def tidy(fig: "plt.Figure") -> Bbox | None:
    """Readable ticks and a title that sits just above the panels.

    Log axes lose minor ticks (half the drawing time, no labels) but get labelled 1-2-5 steps
    when they span too few decades to show three labels; linear axes whose tick labels overlap
    get fewer ticks; the figure title is moved to just above the panels' top edge, centred on
    them (matplotlib puts it at the figure's top, far above a tall heatmap). Returns the tight
    box of the result in display pixels (None for a figure without visible axes)."""
    for ax in fig.axes:
        for axis, scale in _axes_scales(ax):
            if scale == "log":
                axis.set_minor_locator(NullLocator())
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    changed = False
    for ax in fig.axes:
        if not ax.axison:
            continue
        for axis, scale in _axes_scales(ax):
            if scale == "log" and len(_ticks_in_view(axis)) < MIN_LOG_TICKS:
                axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=30))
                axis.set_major_formatter(FuncFormatter(_log_tick))
                changed = True
            elif not _is_categorical(axis):
                changed |= _thin(axis, renderer)
    if changed:
        fig.draw_without_rendering()
    return _place_title(fig, renderer)


def _is_categorical(axis) -> bool:
    """Named ticks (a bar per format, a row per tensor): thinning them would hide names."""
    return isinstance(axis.get_major_formatter(), (FixedFormatter, StrCategoryFormatter))


def _thin(axis, renderer) -> bool:
    """Keep every k-th numeric tick (counting from the one nearest zero) for the smallest k
    whose labels no longer overlap; True when the ticks changed."""
    labels = _ticks_in_view(axis)
    if not _tick_overlaps(labels, renderer):
        return False
    locs = [t.get_position()[0 if axis.axis_name == "x" else 1] for t in labels]
    zero = int(np.argmin(np.abs(locs)))
    for k in range(2, len(labels)):
        keep = [i for i in range(len(labels)) if (i - zero) % k == 0]
        if not _tick_overlaps([labels[i] for i in keep], renderer):
            break
    axis.set_major_locator(FixedLocator([locs[i] for i in keep]))
    return True


def _place_title(fig: "plt.Figure", renderer) -> Bbox | None:
    """Put the title just above the panels, centred on them; returns the box (display pixels)
    around panels and title, the figure's tight box."""
    title = fig._suptitle
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes if ax.get_visible()]
    boxes = [b for b in boxes if b is not None and b.width > 0]
    if not boxes:
        return None
    if title is not None:
        x0, x1 = min(b.x0 for b in boxes), max(b.x1 for b in boxes)
        top = max(b.y1 for b in boxes)
        pad = 0.6 * title.get_fontsize() * fig.dpi / 72
        title.set_position(((x0 + x1) / 2 / fig.bbox.width, (top + pad) / fig.bbox.height))
        title.set_verticalalignment("bottom")
        boxes.append(title.get_window_extent(renderer))
    return Bbox.union(boxes)


def _is_pie(ax) -> bool:
    return bool(ax.patches) and all(isinstance(p, Wedge) for p in ax.patches)


def _texts(ax, renderer) -> list[tuple[str, object]]:
    """(what, window extent) of every piece of text an axes draws outside its data area."""
    out = []
    for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
        out += [(f"{name} tick {t.get_text()!r}", t.get_window_extent(renderer)) for t in _ticks_in_view(axis)]
        offset = axis.get_offset_text()
        if offset.get_visible() and offset.get_text():
            out.append((f"{name} offset {offset.get_text()!r}", offset.get_window_extent(renderer)))
        if axis.label.get_visible() and axis.label.get_text():
            out.append((f"{name} label {axis.label.get_text()!r}", axis.label.get_window_extent(renderer)))
    if ax.title.get_text():
        out.append((f"title {ax.title.get_text()!r}", ax.title.get_window_extent(renderer)))
    return out


def layout_problems(fig: "plt.Figure", drawn: bool = False) -> list[str]:
    """What a reader would stumble on: no figure title, a panel without axis labels, tick labels
    of one axis overlapping each other, notes inside a panel running into each other or its
    legend, text of one panel (tick labels, axis labels, a colourbar's label, titles) running
    into another panel's. Measured with matplotlib's own text extents;
    ``drawn``: the figure's layout is current (``tidy`` just drew it), skip drawing again."""
    if not drawn:
        fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    problems = []
    title = fig._suptitle
    if title is None or not title.get_text().strip():
        problems.append("figure has no title")
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    texts = {}
    for i, ax in enumerate(panels):
        colorbar = ax.get_label() == "<colorbar>"
        name = f"panel {i} ({ax.get_title() or ('colourbar' if colorbar else 'untitled')!r})"
        if not colorbar and not _is_pie(ax) and not (ax.get_xlabel() and ax.get_ylabel()):
            problems.append(f"{name}: missing axis label (x {ax.get_xlabel()!r}, y {ax.get_ylabel()!r})")
        for axis, which in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            if _tick_overlaps(_ticks_in_view(axis), renderer):
                labels = [t.get_text() for t in _ticks_in_view(axis)]
                problems.append(f"{name}: {which} tick labels overlap {labels}")
        own = _texts(ax, renderer)
        titles = [box for what, box in own if what.startswith("title")]
        offsets = [(what, box) for what, box in own if " offset " in what]
        problems += [f"{name}: {what} runs into the panel title" for what, box in offsets
                     for t in titles if _collide(box, t)]
        notes = [(f"text {t.get_text()!r}", t.get_window_extent(renderer)) for t in ax.texts
                 if t.get_visible() and t.get_text()]
        legend = ax.get_legend()
        if legend is not None and legend.get_visible():
            notes.append(("legend", legend.get_window_extent(renderer)))
        problems += [f"{name}: {a} runs into {b}" for (a, box_a), (b, box_b) in itertools.combinations(notes, 2)
                     if _collide(box_a, box_b)]
        if legend is not None and legend.get_visible():
            box = legend.get_window_extent(renderer)
            if _covers_data(ax, box):
                problems.append(f"{name}: the legend covers data (put it outside: legend_outside)")
            own.append(("legend", box))
        texts[i] = (name, own)
    if title is not None and title.get_text():
        texts[-1] = ("figure title", [("title", title.get_window_extent(renderer))])
    for (i, (name_a, a)), (j, (name_b, b)) in itertools.combinations(texts.items(), 2):
        for (what_a, box_a), (what_b, box_b) in itertools.product(a, b):
            if _collide(box_a, box_b):
                problems.append(f"{name_a} {what_a} runs into {name_b} {what_b}")
    return problems


def _inside(points: np.ndarray, box) -> bool:
    return bool(np.any((points[:, 0] > box.x0) & (points[:, 0] < box.x1)
                       & (points[:, 1] > box.y0) & (points[:, 1] < box.y1)))


def _covers_data(ax, box) -> bool:
    """A legend box (display pixels) over a line, a marker, a bar or a filled area of ``ax``:
    what the reader came to see is hidden behind the names of it."""
    if not _collide(box, ax.get_window_extent(), 0.0):
        return False                                      # outside the panel
    for line in ax.lines:
        if line.get_visible() and len(line.get_xydata()):
            path = line.get_transform().transform_path(line.get_path())
            if path.intersects_bbox(box, filled=False) or _inside(path.vertices, box):
                return True
    for coll in ax.collections:
        if not coll.get_visible():
            continue
        offsets = np.asarray(coll.get_offsets())
        if len(offsets) and np.any(offsets):              # markers (scatter)
            if _inside(coll.get_offset_transform().transform(offsets), box):
                return True
            continue
        for path in coll.get_paths():                     # areas (fill_between)
            if coll.get_transform().transform_path(path).intersects_bbox(box, filled=True):
                return True
    for patch in ax.patches:                              # bars, histograms
        if patch.get_visible() and not isinstance(patch, Wedge):
            path = patch.get_transform().transform_path(patch.get_path())
            if path.intersects_bbox(box, filled=bool(patch.get_fill())):
                return True
    return False
