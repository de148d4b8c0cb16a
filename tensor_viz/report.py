"""OUT/index.html: a static page (opens from disk, relative image paths, no scripts) with every
figure, captions, and summary tables of the worst tensors; OUT/problems.txt lists bad input."""
from __future__ import annotations

import html
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tensor_viz.catalog import Catalog, Entry
from tensor_viz.data import Dataset, group, ratio

if TYPE_CHECKING:
    from tensor_viz.pipeline import Options, Result

TOP = 10
MAX_PROBLEMS_SHOWN = 50

CSS = """body{font-family:sans-serif;margin:2em;max-width:1300px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #bbb;padding:3px 8px;
font-size:13px;text-align:left}th{background:#eee}figure{margin:1em 0 2em}img{max-width:100%;
border:1px solid #ddd}figcaption{font-size:14px;max-width:900px}.note{background:#fff7d6;padding:6px 10px}
nav a{margin-right:10px}code{background:#f3f3f3}"""


def _e(text) -> str:
    return html.escape(str(text))


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


def _worst_table(title: str, rows: list[tuple[Entry, float]], what: str) -> str:
    if not rows:
        return f"<h3>{_e(title)}</h3><p class=note>No tensor has any {_e(what)}.</p>"
    out = [f"<h3>{_e(title)}</h3><table><tr><th>tensor</th><th>iteration</th><th>rank</th>"
           "<th>quant type</th><th>against</th><th>% of elements</th><th>file</th></tr>"]
    for e, r in rows:
        rs = e.range_stats()
        out.append(f"<tr><td>{_e(e.label)}</td><td>{_e(e.name.iteration)}</td><td>{_e(e.name.rank)}</td>"
                   f"<td>{_e(e.name.quant_type)}</td><td>{_e(rs[0] if rs else '')}</td><td>{100 * r:.4g}</td>"
                   f"<td>{_e(os.path.basename(e.path) if e.path else 'stats only')}</td></tr>")
    return "".join(out) + "</table>"


def write_problems(catalog: Catalog, out: Path) -> None:
    lines = [f"{p.kind}\t{p.path}\t{p.reason}" for p in catalog.problems]
    tmp = out / ".problems.tmp.txt"
    tmp.write_text(("\n".join(lines) + "\n") if lines else "no problems\n", encoding="utf-8")
    os.replace(tmp, out / "problems.txt")


def write_index(result: "Result", out: Path, sections: tuple[str, ...], opts: "Options") -> str:
    """Write OUT/index.html (temp name, then rename); returns its name."""
    from tensor_viz.pipeline import SECTIONS

    ds, cat, fs = result.dataset, result.catalog, result.figures
    parts = ["<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
             "<title>Tensor numerics report</title>", f"<style>{CSS}</style></head><body>",
             "<h1>Tensor numerics report</h1>",
             f"<p>Directory <code>{_e(cat.directory)}</code>: {len(ds.entries)} tensors "
             f"({sum(1 for e in ds.entries if e.source == 'manifest')} from manifests), values read from "
             f"{result.files_read} files ({opts.sample_size} values each, seed {opts.seed}); "
             f"{len(ds.pairs)} high-precision/quantized pairs compared; "
             f"{result.drawn} figures.</p>"]
    nav = [f"<a href='#{s}'>{_e(s)}</a>" for s in sections]
    parts.append("<nav>" + " ".join(["<a href='#summary'>summary</a>", "<a href='#problems'>problems</a>"] + nav)
                 + "</nav>")
    parts.append("<h2 id=summary>Summary: where to look first</h2>")
    parts.append(_worst_table("Worst overflow (|x| above the format's largest value)",
                              worst(ds.entries, "overflow_ratio"), "overflow"))
    parts.append(_worst_table("Worst underflow (nonzero |x| below the smallest normal)",
                              worst(ds.entries, "underflow_ratio"), "underflow"))
    parts.append(_worst_table("Worst flush-to-zero (nonzero |x| that becomes 0)",
                              worst(ds.entries, "flush_to_zero_ratio"), "flush-to-zero"))
    rows = largest_error_per_layer(ds)
    parts.append("<h3>Largest quantization error per layer</h3>")
    if rows:
        parts.append("<table><tr><th>layer</th><th>measured (saved quantized vs high precision)</th>"
                     "<th>what-if (worst format, quant/)</th></tr>"
                     + "".join(f"<tr><td>{_e(a)}</td><td>{_e(b)}</td><td>{_e(c)}</td></tr>" for a, b, c in rows)
                     + "</table>")
    else:
        parts.append("<p class=note>No quantization error could be computed: "
                     f"{_e(ds.notes.get('quantization_analysis', 'no operand pairs saved and no what-if formats'))}."
                     "</p>")
    parts.append("<h2 id=problems>Input problems</h2>")
    counts = cat.problem_counts()
    if counts:
        parts.append("<p>" + ", ".join(f"{_e(k)}: {n}" for k, n in sorted(counts.items()))
                     + " (all listed in <a href='problems.txt'>problems.txt</a>)</p><table><tr><th>kind</th>"
                     "<th>file</th><th>reason</th></tr>")
        parts += [f"<tr><td>{_e(p.kind)}</td><td>{_e(p.path)}</td><td>{_e(p.reason)}</td></tr>"
                  for p in cat.problems[:MAX_PROBLEMS_SHOWN]]
        parts.append("</table>")
    else:
        parts.append("<p>None: every file was readable.</p>")
    quick = fs.in_section("quick")
    if quick:
        parts.append("<h2 id=quick>Quick analysis</h2>" + "".join(_figure(f) for f in quick))
    for s in sections:
        parts.append(f"<h2 id='{_e(s)}'>{_e(s)}</h2><p>{_e(SECTIONS[s][1])}</p>")
        figs = fs.in_section(s)
        for f in figs:
            if f.placeholder:
                parts.append(f"<p class=note>Nothing to draw: {_e(f.caption)}.</p>")
            parts.append(_figure(f))
    parts.append("</body></html>")
    tmp = out / ".index.tmp.html"
    tmp.write_text("\n".join(parts), encoding="utf-8")
    os.replace(tmp, out / "index.html")
    return "index.html"


def _figure(f) -> str:
    return (f"<figure><img src='{_e(f.path)}' alt='{_e(f.title)}'><figcaption><b>{_e(f.title)}.</b> "
            f"{_e(f.caption)}</figcaption></figure>")
