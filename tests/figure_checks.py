"""Every saved figure checked for a title, a caption, axis labels and units (the report tests).

Installed in the test process (``install(root)``) and, through the drawing workers' initializer
(``init_worker_with_checks``, which the test puts in place of pipeline._set_draw_state), in
every worker process: the workers are not forks of the test process, so a patch made here
alone would not reach them. Results go to ROOT/checked.txt and ROOT/violations.txt.
"""
from __future__ import annotations

from pathlib import Path

from matplotlib.category import StrCategoryFormatter
from matplotlib.ticker import FixedFormatter, FixedLocator, FuncFormatter

from tensor_viz import figures, pipeline

#: words that stand where a unit should be named (dimensionless, binade, dB, % of elements, ...)
VAGUE_UNITS = ("tensor units", "std units", "value unit", "normalized unit")
ORIGINAL_SAVE = figures.FigureSet.save
REAL_INIT = pipeline._set_draw_state
_ROOT: list[Path] = []


def _problems(fig, title, caption) -> list[str]:
    bad = []
    if not title or not caption:
        bad.append("no title/caption")
    for ax in fig.axes:
        if not ax.axison or ax.get_label() == "<colorbar>":
            continue
        if ax.name != "polar" and ax.get_xlabel() == "" and ax.get_ylabel() == "" and not ax.patches[:0]:
            if not any(isinstance(c, type(ax.pie)) for c in ax.get_children()):
                bad.append(f"axes '{ax.get_title()}' without labels")
        for axis, label in ((ax.xaxis, ax.get_xlabel()), (ax.yaxis, ax.get_ylabel())):
            fmt, loc = axis.get_major_formatter(), axis.get_major_locator()
            categorical = isinstance(fmt, (FixedFormatter, StrCategoryFormatter)) or (
                isinstance(loc, FixedLocator) and isinstance(fmt, FuncFormatter))  # named ticks
            if label and "(" not in label and not categorical:
                bad.append(f"numeric axis label without unit: {label!r}")
            if any(vague in label for vague in VAGUE_UNITS):
                bad.append(f"axis label with an unnamed unit: {label!r}")
    return bad


def checked_save(self, fig, section, name, title, caption, subset=None):
    root = _ROOT[0]
    bad = _problems(fig, title, caption)
    with open(root / "checked.txt", "a") as fh:
        fh.write(f"{section}/{name}\n")
    if bad:
        with open(root / "violations.txt", "a") as fh:
            fh.write(f"{section}/{name}: {bad}\n")
    return ORIGINAL_SAVE(self, fig, section, name, title, caption, subset)


def install(root: Path) -> None:
    _ROOT[:] = [Path(root)]
    figures.FigureSet.save = checked_save


def uninstall() -> None:
    figures.FigureSet.save = ORIGINAL_SAVE


def init_worker_with_checks(ds, out_dir, opts) -> None:
    """The drawing workers' initializer: the checks (results beside OUT_DIR), then the real one."""
    install(Path(out_dir).parent)
    REAL_INIT(ds, out_dir, opts)
