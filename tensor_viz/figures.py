"""Saving figures: one PNG per figure, closed at once, with a title and a caption.

Every section folder gets at least one file: a real figure, or a placeholder image that
says why there is nothing to draw (the index lists it as a note).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

from lowp_common import atomic_path  # noqa: E402

plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "figure.titlesize": 13,
                     "axes.grid": True, "grid.alpha": 0.3})

VALUE_AXIS = "value (tensor units)"
COUNT_AXIS = "count (values)"
FILES_AXIS = "count (files)"
DENSITY_AXIS = "density (1 / value unit)"
LOG2_AXIS = "log2 |value| (binade)"
PERCENT_AXIS = "ratio (% of elements)"


@dataclass
class Figure:
    section: str
    path: str            # relative to the output directory, '/' separated
    title: str
    caption: str
    placeholder: bool = False


@dataclass
class FigureSet:
    out_dir: Path
    dpi: int = 90
    figures: list[Figure] = field(default_factory=list)

    def start_section(self, section: str) -> None:
        """Empty OUT/section of the PNGs a previous run drew, so the folder matches this run."""
        folder = self.out_dir / section
        if folder.is_dir():
            for old in folder.glob("*.png"):
                old.unlink()

    def save(self, fig: "plt.Figure", section: str, name: str, title: str, caption: str) -> Figure:
        """Write ``fig`` to OUT/section/name.png (temp name, then rename) and close it."""
        folder = self.out_dir / section
        folder.mkdir(parents=True, exist_ok=True)
        fig.suptitle(title)
        for ax in fig.axes:  # minor ticks of log axes cost half the drawing time and add no labels
            for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
                if scale == "log":
                    axis.set_minor_locator(NullLocator())
        try:
            with atomic_path(folder / f"{name}.png") as tmp:
                fig.savefig(tmp, format="png", dpi=self.dpi, bbox_inches="tight")
        finally:
            plt.close(fig)
        record = Figure(section, f"{section}/{name}.png", title, caption)
        self.figures.append(record)
        return record

    def placeholder(self, section: str, reason: str) -> Figure:
        """A figure that says, in words, why the section is empty."""
        fig, ax = plt.subplots(figsize=(6, 2.2))
        ax.axis("off")
        ax.text(0.5, 0.5, f"No data for {section}:\n{reason}", ha="center", va="center", wrap=True)
        record = self.save(fig, section, "no_data", f"{section}: nothing to draw", reason)
        record.placeholder = True
        return record

    def drawn(self) -> int:
        return sum(1 for f in self.figures if not f.placeholder)

    def in_section(self, section: str) -> list[Figure]:
        return [f for f in self.figures if f.section == section]


def grid(n: int, ncols: int = 3, size: tuple[float, float] = (4.6, 3.4)):
    """A figure with ``n`` axes in rows of ``ncols``; unused axes are hidden."""
    ncols = max(1, min(ncols, n))
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)
    height = size[1] * nrows
    fig.subplots_adjust(hspace=0.55, wspace=0.35, top=1 - 0.75 / height, bottom=0.45 / height)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.axis("off")
    return fig, flat[:n]


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
    ax.legend()
    ax.set(xlabel=xlabel, ylabel=DENSITY_AXIS)
    return fs.save(fig, section, name, title, caption)
