"""OUT/index.html: a static page (opens from disk, relative image paths, no scripts) with every
figure, captions, and summary tables of the worst tensors; OUT/problems.txt lists bad input.

The page is rendered from ``tensor_viz/templates/report.html.j2`` with jinja2 autoescaping, so a
tensor name, path or caption can never inject markup; this module only gathers the data."""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2

from lowp_common import atomic_write_text
from tensor_viz import interactive, numerics_data, rank_tables
from tensor_viz.catalog import Catalog, Entry
from tensor_viz.data import Dataset, group, ratio
from tensor_viz.figures import NO_DATA, Figure, subset_note
from tensor_viz.options import SECTION_DESCRIPTIONS, Options
from tensor_viz.result import Result

if TYPE_CHECKING:
    from tensor_viz.diagnose import Diagnosis

TOP = 10
MAX_PROBLEMS_SHOWN = 50
MAX_FINDINGS_SHOWN = 20
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


def _measured_per_layer(ds: Dataset) -> dict[str, str]:
    """{layer: the worst measured error (saved quantized operand vs its high-precision twin)}."""
    out = {}
    for layer, pairs in group(ds.pairs, lambda p: p.hp.layer_label).items():
        p = max(pairs, key=lambda p: p.errors["relative_error"])
        out[layer] = (f"{100 * p.errors['relative_error']:.3g}% ({p.hp.name.tensor_name}, "
                      f"{p.quantized.name.quant_type}, SQNR {p.errors['sqnr']:.1f} dB)")
    return out


def _sqnr_text(v: float) -> str:
    return "exact" if v == math.inf else f"{v:.1f} dB"


def _loss_mark(r: dict) -> str:
    """' (N dB below Gaussian: HIGH)' when quant.format_loss judges the tensor bad in the format
    (its SQNR against the format's own on Gaussian data of its shape and axis), else ''."""
    from quant.format_loss import baseline_sqnr, loss_severity

    shape = tuple(r.get("shape") or ()) or (1,)
    try:
        base = baseline_sqnr(r["format"], shape, int(r.get("axis") if r.get("axis") is not None else -1))
    except (KeyError, ValueError, IndexError):
        return ""
    sev = loss_severity(r["sqnr_db"], base)
    return "" if sev == "none" else f" ({base - r['sqnr_db']:.1f} dB below Gaussian: {sev.upper()})"


def _whatif_cell(r: dict | None) -> dict:
    """One format's cell of a layer: its worst SQNR, relative error and where (tensor, iteration);
    ``short``: that tensor's block axis is shorter than one block (marked, not dropped); a mark
    when the one judgment of a format's loss (quant.format_loss) calls it bad; ``recomputed``:
    capture did not store that number, the report recomputed it on the axis capture used."""
    if r is None:
        return {"text": "", "detail": "", "short": False, "recomputed": False}
    rel = "" if r["rel_error"] is None else f", {100 * r['rel_error']:.3g}%"
    return {"text": _sqnr_text(r["sqnr_db"]) + rel + _loss_mark(r),
            "detail": f"{r['operation']} {r['tensor_name']}, iteration {r['iteration']}",
            "short": bool(r.get("short_axis")),
            "recomputed": r.get("source") == numerics_data.SOURCE_RECOMPUTED}


def largest_error_per_layer(ds: Dataset) -> dict:
    """The per-layer table: measured worst error, and each what-if format's worst SQNR (over the
    tensors and iterations of the layer) with the formats ranked best first. The what-if
    numbers are those capture stored (numerics_data rows), and only what it did not store is
    recomputed from saved tensors on the same axis (marked), so the ranking compares the
    formats a run would choose between."""
    measured = _measured_per_layer(ds)
    worst = numerics_data.worst_per_layer(ds.numerics)
    fmts = numerics_data.formats(ds.numerics)
    rows = []
    for layer in sorted(set(measured) | set(worst)):
        w = worst.get(layer, {})
        ranked = numerics_data.ranked_formats(w)
        rows.append({"layer": layer, "measured": measured.get(layer, "not saved"),
                     "cells": [_whatif_cell(w.get(f)) for f in fmts],
                     "ranking": " > ".join(f for f, _ in ranked) or "not computed"})
    return {"formats": fmts, "rows": rows,
            "short": any(c["short"] for r in rows for c in r["cells"]),
            "recomputed": any(c["recomputed"] for r in rows for c in r["cells"])}


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
    view = cat.view
    worst_tables = []
    for title, key, what in WORST_TABLES:
        rows = _worst_rows(worst(ds.entries, key))
        n_any = sum(1 for e in ds.entries if ratio(e, key))
        worst_tables.append({"title": title, "what": what, "rows": rows,
                             "subset": subset_note(len(rows), n_any, f"tensors with any {what}",
                                                   "those with the largest ratios")})
    return _template().render(
        diagnosis=_diagnosis_view(result.diagnosis),
        directory=cat.directory, n_tensors=len(ds.entries),
        capture_header=view.header.line() if view is not None else None,
        selected=cat.selected,
        outlier_ranks=(view.outliers if view is not None and view.header.ranks >= 3 else None),
        outlier_z=rank_tables.OUTLIER_Z, rel_floor=rank_tables.REL_FLOOR,
        outlier_metrics=", ".join(rank_tables.METRICS),
        n_from_manifest=sum(1 for e in ds.entries if e.source == "manifest"),
        files_read=result.files_read, sample_size=opts.sample_size, seed=opts.seed,
        n_pairs=len(ds.pairs), drawn=result.drawn, worst_tables=worst_tables,
        per_layer=largest_error_per_layer(ds),
        interactive=interactive.charts(ds, opts.map_stats),
        interactive_skipped=interactive.skipped(ds),
        not_drawn=_not_drawn(fs.figures, sections),
        no_error_reason=("no quantized operands were saved (capture with save_quantized: true) "
                         "and no what-if numerics were stored (whatif_formats: default) or "
                         "could be recomputed from saved tensors"),
        problem_counts=sorted(cat.problem_counts().items()),
        problems=cat.problems[:MAX_PROBLEMS_SHOWN], quick=fs.in_section("quick"),
        problems_subset=subset_note(min(len(cat.problems), MAX_PROBLEMS_SHOWN), len(cat.problems), "problems",
                                    "the first in reading order; problems.txt lists all"),
        sections=[{"name": s, "description": SECTION_DESCRIPTIONS[s],
                   "figures": [f for f in fs.in_section(s) if not f.placeholder],
                   "skipped": [f for f in fs.in_section(s) if f.placeholder]}
                  for s in sections])


def _not_drawn(figures: list[Figure], sections: tuple[str, ...]) -> list[dict]:
    """The summary's list of what was left out and why (instead of empty boxes among the
    figures): a whole section with nothing to draw, or one figure (a plot over iterations of a
    capture of one iteration, a ratio that is zero everywhere), in section order."""
    order = {s: i for i, s in enumerate(sections)}
    skipped = sorted((f for f in figures if f.placeholder), key=lambda f: order.get(f.section, len(order)))
    return [{"section": f.section, "title": f.title, "reason": f.caption,
             "whole": f.path.endswith("/" + NO_DATA)} for f in skipped]


def _diagnosis_view(diagnosis: Diagnosis | None) -> dict | None:
    """What the page's Diagnosis section shows: the findings (the cause first) and what was
    checked; None without manifests (lowp-diagnose reads the capture's manifests)."""
    if diagnosis is None:
        return None
    rows = []
    for f in diagnosis.findings[:MAX_FINDINGS_SHOWN]:
        d = f.to_dict()
        where = ", ".join(f"{label} {d[k]}" for k, label in (
            ("iteration", "iteration"), ("sample_idx", "micro-batch"), ("rank", "rank"))
            if d.get(k) is not None)
        rows.append({"severity": f.severity, "kind": f.kind, "summary": f.summary,
                     "where": where, "figure": f.figure, "action": f.action})
    return {"rows": rows, "more": max(len(diagnosis.findings) - MAX_FINDINGS_SHOWN, 0),
            "checked": sorted(diagnosis.checked.items()), "records": diagnosis.records}


@functools.lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    """The page template, shipped as package data; autoescape on, undefined names are errors."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("tensor_viz", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    return env.get_template(TEMPLATE)
