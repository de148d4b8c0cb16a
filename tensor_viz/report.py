"""OUT/index.html: a static page (opens from disk, relative image paths, no scripts) with every
figure, captions, and summary tables of the worst tensors; OUT/problems.txt lists bad input.

The page is rendered from ``tensor_viz/templates/report.html.j2`` with jinja2 autoescaping, so a
tensor name, path or caption can never inject markup; this module only gathers the data."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import jinja2

from lowp_common import atomic_write_text
from tensor_viz.catalog import Catalog, Entry
from tensor_viz.data import Dataset, group, ratio
from tensor_viz.figures import subset_note
from tensor_viz.options import SECTION_DESCRIPTIONS, Options
from tensor_viz.result import Result

TOP = 10
MAX_PROBLEMS_SHOWN = 50
TEMPLATE = "report.html.j2"

#: The summary's "worst" tables: (title, ratio key of the range statistics, what it counts).
WORST_TABLES = (
    ("Worst overflow (|x| above the format's largest value)", "overflow_ratio", "overflow"),
    ("Worst underflow (nonzero |x| below the smallest normal)", "underflow_ratio", "underflow"),
    ("Worst flush-to-zero (nonzero |x| that becomes 0)", "flush_to_zero_ratio", "flush-to-zero"),
)

def worst(entries: list[Entry], key: str, n: int = TOP) -> list[tuple[Entry, float]]:
    """The ``n`` entries with the largest nonzero ``key`` ratio against their own format."""
    scored = [(e, r) for e in entries if (r := ratio(e, key))]
    return sorted(scored, key=lambda er: -er[1])[:n]


def largest_error_per_layer(ds: Dataset) -> list[tuple[str, str, str]]:
    """(layer, measured worst, what-if worst) as text, one row per layer."""
    measured = group(ds.pairs, lambda p: p.hp.layer_label)
    whatif = group([e for e in ds.entries if e.whatif], lambda e: e.layer_label)
    rows = []
    for layer in sorted(set(measured) | set(whatif)):
        m = ""
        if layer in measured:
            p = max(measured[layer], key=lambda p: p.errors["relative_error"])
            m = (f"{100 * p.errors['relative_error']:.3g}% ({p.hp.name.tensor_name}, "
                 f"{p.quantized.name.quant_type}, SQNR {p.errors['sqnr']:.1f} dB)")
        w = ""
        if layer in whatif:
            best = None
            for e in whatif[layer]:
                for fmt, err in e.whatif.items():
                    if best is None or err["relative_error"] > best[2]["relative_error"]:
                        best = (e, fmt, err)
            if best:
                w = (f"{100 * best[2]['relative_error']:.3g}% under {best[1]} ({best[0].name.tensor_name}, "
                     f"SQNR {best[2]['sqnr']:.1f} dB)")
        rows.append((layer, m or "not saved", w or "not computed"))
    return rows


def _worst_rows(rows: list[tuple[Entry, float]]) -> list[dict]:
    """One table row per entry: the values the template shows (it escapes them)."""
    out = []
    for e, r in rows:
        rs = e.range_stats()
        out.append({"label": e.label, "iteration": e.name.iteration, "rank": e.name.rank,
                    "quant_type": e.name.quant_type, "against": rs[0] if rs else "",
                    "percent": 100 * r, "file": os.path.basename(e.path) if e.path else "stats only"})
    return out


def write_problems(catalog: Catalog, out: Path) -> None:
    lines = [f"{p.kind}\t{p.path}\t{p.reason}" for p in catalog.problems]
    atomic_write_text(out / "problems.txt", ("\n".join(lines) + "\n") if lines else "no problems\n")


def write_index(result: Result, out: Path, sections: tuple[str, ...], opts: Options) -> str:
    """Write OUT/index.html (temp name, then rename); returns its name."""
    atomic_write_text(out / "index.html", render_index(result, sections, opts))
    return "index.html"


def render_index(result: Result, sections: tuple[str, ...], opts: Options) -> str:
    """The page's text: the data of ``result`` through templates/report.html.j2 (autoescaped)."""

    ds, cat, fs = result.dataset, result.catalog, result.figures
    worst_tables = []
    for title, key, what in WORST_TABLES:
        rows = _worst_rows(worst(ds.entries, key))
        n_any = sum(1 for e in ds.entries if ratio(e, key))
        worst_tables.append({"title": title, "what": what, "rows": rows,
                             "subset": subset_note(len(rows), n_any, f"tensors with any {what}",
                                                   "those with the largest ratios")})
    return _template().render(
        directory=cat.directory, n_tensors=len(ds.entries),
        n_from_manifest=sum(1 for e in ds.entries if e.source == "manifest"),
        files_read=result.files_read, sample_size=opts.sample_size, seed=opts.seed,
        n_pairs=len(ds.pairs), drawn=result.drawn, worst_tables=worst_tables,
        per_layer=largest_error_per_layer(ds),
        no_error_reason=ds.notes.get("quantization_analysis",
                                     "no operand pairs saved and no what-if formats"),
        problem_counts=sorted(cat.problem_counts().items()),
        problems=cat.problems[:MAX_PROBLEMS_SHOWN], quick=fs.in_section("quick"),
        problems_subset=subset_note(min(len(cat.problems), MAX_PROBLEMS_SHOWN), len(cat.problems), "problems",
                                    "the first in reading order; problems.txt lists all"),
        sections=[{"name": s, "description": SECTION_DESCRIPTIONS[s], "figures": fs.in_section(s)}
                  for s in sections])


@functools.lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    """The page template, shipped as package data; autoescape on, undefined names are errors."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("tensor_viz", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    return env.get_template(TEMPLATE)
