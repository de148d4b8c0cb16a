"""What-if numerics of a run as one long table, and the report's aggregations over it.

Why a table of plain dicts: numerics.csv, the numerics figures (plots_numerics), the interactive
view and the summary table all read the same rows, one per (captured tensor, what-if format),
built once per report from the catalog's records (``metadata["whatif"]``, tensor_capture.whatif).
Each aggregation below is a small function over those rows, so a query engine can replace any of
them without touching the figures.

The numbers capture stored are shown as stored (``source`` "capture"). What capture did not
store (what-if off, an iteration over the what-if budget, a format the report was asked for
beside the captured ones) is recomputed from the saved high-precision tensor by capture's own
computation, on the axis capture used (:func:`capture_axis`), by the report's file readers
(tensor_viz.file_reads.recompute_whatif, at most ``--whatif-files`` tensors): ``source``
"recomputed".
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any, Iterable

from quant.whatif_record import SCALAR_KEYS
from tensor_capture import schema
from tensor_viz.catalog import Entry
from tensor_viz.options import DEFAULT_WHATIF

#: naming fields copied from each record into every row
NAME_FIELDS = ("layer_type", "layer_idx", "operation", "phase", "component", "tensor_name",
               "iteration", "rank")
#: quant.whatif's numbers, over all elements
NUMBER_FIELDS = SCALAR_KEYS
#: where a row's numbers come from: stored at capture, or recomputed by the report
SOURCE_CAPTURE, SOURCE_RECOMPUTED = "capture", "recomputed"
#: how users group captured tensors: phase (pre/post) x component (attention / linear)
GROUP_ORDER = (("pre", "FA"), ("post", "FA"), ("pre", "linear"), ("post", "linear"))

Row = dict[str, Any]


def number(v: Any) -> float | None:
    """A stored number as a float (the manifest writes inf/nan as strings); None if absent."""
    if isinstance(v, bool) or v is None or v == "":
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _record(w: Any) -> dict[str, Any] | None:
    return w if isinstance(w, dict) and isinstance(w.get(schema.WHATIF_FORMATS), dict) else None


def captured(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The what-if record capture stored in a record's metadata, None when it stored none."""
    return _record(meta.get(schema.META_WHATIF))


def record_axis(meta: dict[str, Any]) -> int | None:
    """The GEMM reduction axis a record names: its what-if axis (when capture took it from the
    GEMM), else its quantization analysis' axis; None when it names none."""
    w = captured(meta)
    if w is not None:
        return int(w[schema.WHATIF_AXIS]) if w.get(schema.WHATIF_AXIS_SOURCE) == schema.AXIS_FROM_GEMM \
            else None
    analysis = meta.get(schema.META_QUANT_ANALYSIS)
    for a in (analysis.values() if isinstance(analysis, dict) else ()):
        if isinstance(a, dict) and isinstance(a.get("axis"), int):
            return a["axis"]
    return None


def _site(e: Entry) -> tuple:
    """What decides a captured tensor's GEMM axis (the capture hooks' plan entry)."""
    return (e.name.layer_type, e.name.operation, e.name.tensor_name)


def site_axes(entries: Iterable[Entry]) -> dict[tuple, int]:
    """{(layer type, pass, tensor name): the GEMM reduction axis} as the records say it."""
    out: dict[tuple, int] = {}
    for e in entries:
        a = record_axis(e.meta)
        if a is not None:
            out.setdefault(_site(e), a)
    return out


def capture_axis(entry: Entry, axes: dict[tuple, int]) -> int | None:
    """The axis capture's what-if numerics run along for ``entry``: its record's stored what-if
    axis, else its quantization analysis' axis (the reduction axis of the GEMM the tensor
    feeds), else what another record of the same site says (``axes``: :func:`site_axes`, e.g.
    an iteration that got what-if numbers); None: no record names one (capture's last axis)."""
    a = record_axis(entry.meta)
    return a if a is not None else axes.get(_site(entry))


def report_formats(entries: Iterable[Entry], requested: tuple[str, ...] | None) -> tuple[str, ...]:
    """The report's what-if formats: every format capture stored (in its order), plus those
    ``requested`` (--whatif); ``requested`` None: the captured ones, or DEFAULT_WHATIF when
    capture stored none."""
    stored: dict[str, None] = {}
    for e in entries:
        w = captured(e.meta)
        if w is not None:
            stored.update(dict.fromkeys(w[schema.WHATIF_FORMATS]))
    if requested is None:
        return tuple(stored) or tuple(DEFAULT_WHATIF)
    return tuple(dict.fromkeys((*stored, *requested)))


def missing_formats(entry: Entry, formats: Iterable[str]) -> tuple[str, ...]:
    """The formats of ``formats`` the entry's record holds no captured numbers for."""
    w = captured(entry.meta)
    have = w[schema.WHATIF_FORMATS] if w is not None else {}
    return tuple(f for f in formats if f not in have)


def _sources(e: Entry) -> Iterable[tuple[dict[str, Any], str]]:
    """The entry's what-if records: captured, then the report's recomputation (its formats only)."""
    for w, source in ((captured(e.meta), SOURCE_CAPTURE), (_record(e.whatif), SOURCE_RECOMPUTED)):
        if w is not None:
            yield w, source


def rows(entries: Iterable[Entry]) -> list[Row]:
    """One row per (entry, what-if format): the naming fields, ``file`` (basename, '' for a
    stats-only record), ``label`` / ``layer`` (the report's tensor and layer names),
    ``quant_type``, ``format``, the numbers (None where the format failed), the block
    scale (``block_scale_min/max/std``, ``scale_kind``, ``scale_hist``), ``short_axis`` (None
    for formats without blocks), ``sampled``, ``axis`` and ``source`` (SOURCE_CAPTURE: stored
    at capture; SOURCE_RECOMPUTED: by the report, for a format capture did not store)."""
    out: list[Row] = []
    for e in entries:
        for w, source in _sources(e):
            out += _format_rows(e, w, source)
    return out


def _format_rows(e: Entry, w: dict[str, Any], source: str) -> list[Row]:
    base = {"file": os.path.basename(e.path) if e.path else "",
            **{k: getattr(e.name, k) for k in NAME_FIELDS},
            "label": e.label, "layer": e.layer_label, "quant_type": e.name.quant_type,
            "sampled": bool(w.get(schema.WHATIF_SAMPLED)), "source": source,
            # for the format's Gaussian baseline (quant.format_loss): the same shape and axis
            "shape": e.meta.get(schema.META_SHAPE), "axis": w.get(schema.WHATIF_AXIS)}
    out: list[Row] = []
    for fmt, num in w[schema.WHATIF_FORMATS].items():
        num = num if isinstance(num, dict) else {}
        scale = num.get("block_scale") if isinstance(num.get("block_scale"), dict) else {}
        row = dict(base, format=fmt, error=num.get("error"))
        row.update({k: number(num.get(k)) for k in NUMBER_FIELDS})
        row.update({f"block_scale_{k}": number(scale.get(k)) for k in ("min", "max", "std")})
        row["scale_kind"] = scale.get("kind")
        row["scale_hist"] = scale.get("hist") if isinstance(scale.get("hist"), dict) else None
        row["short_axis"] = num.get("short_axis") if "short_axis" in num else None
        out.append(row)
    return out


def formats(table: list[Row]) -> list[str]:
    """The what-if formats present, in the order the capture listed them."""
    return list(dict.fromkeys(r["format"] for r in table))


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def row_key(r: Row, mixed: bool) -> str:
    """A timeline / map row: layer and tensor, plus the captured quant type when runs mix them."""
    return r["label"] + (f" [{r['quant_type']}]" if mixed else "")


def _iteration_order(its: Iterable[Any]) -> list[Any]:
    return sorted(set(its), key=lambda i: (i is None, i if i is not None else 0))


def iterations(table: list[Row]) -> list[Any]:
    """The captured iterations with what-if numbers, in order (None last)."""
    return _iteration_order(r["iteration"] for r in table)


def timeline(table: list[Row], fmt: str, value: str = "sqnr_db"
             ) -> tuple[list[str], list[Any], dict[tuple[str, Any], float]]:
    """(row keys, iterations, {(row, iteration): worst value}) of ``fmt``: the lowest SQNR (the
    highest for a ratio) over ranks and micro-batches; infinite SQNR (exact) is kept as inf."""
    mixed = len({r["quant_type"] for r in table}) > 1
    worse = min if value == "sqnr_db" else max
    cells: dict[tuple[str, Any], float] = {}
    for r in table:
        v = r.get(value)
        if r["format"] != fmt or v is None or math.isnan(v):
            continue
        k = (row_key(r, mixed), r["iteration"])
        cells[k] = worse(cells[k], v) if k in cells else v
    keys = sorted({k for k, _ in cells})
    return keys, _iteration_order(i for _, i in cells), cells


def block_scale_hist(table: list[Row], fmt: str, by: str = "operation"
                     ) -> dict[Any, dict[int, int]]:
    """{group: {bin: blocks}}: the stored block-scale histograms of ``fmt`` summed over tensors,
    grouped by the naming field ``by`` (bins: the MX E8M0 exponent, or the binade
    floor(log2 s) of the NVFP4 E4M3 block scale)."""
    out: dict[Any, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in table:
        h = r.get("scale_hist")
        if r["format"] != fmt or not h or h.get("min_bin") is None:
            continue
        for i, n in enumerate(h.get("counts") or []):
            if n:
                out[r[by]][int(h["min_bin"]) + i] += int(n)
    return {g: dict(sorted(c.items())) for g, c in sorted(out.items(), key=lambda kv: str(kv[0]))}


def scale_kind(table: list[Row], fmt: str) -> str | None:
    """The block-scale kind of ``fmt`` (quant.whatif.SCALE_KIND_*), None for other formats."""
    return next((r["scale_kind"] for r in table if r["format"] == fmt and r["scale_kind"]), None)


def by_phase_component(table: list[Row], fmt: str, value: str = "sqnr_db"
                       ) -> dict[tuple[str, str], list[float]]:
    """{(phase, component): finite values of ``fmt``}, the four known groups first."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in table:
        if r["format"] == fmt and _finite(r.get(value)):
            out[(r["phase"], r["component"])].append(r[value])
    order = {g: i for i, g in enumerate(GROUP_ORDER)}
    return dict(sorted(out.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def worst_per_layer(table: list[Row]) -> dict[str, dict[str, Row]]:
    """{layer: {format: the row with the lowest SQNR}} over every tensor and iteration."""
    out: dict[str, dict[str, Row]] = defaultdict(dict)
    for r in table:
        v = r.get("sqnr_db")
        if v is None or math.isnan(v):
            continue
        cur = out[r["layer"]].get(r["format"])
        if cur is None or v < cur["sqnr_db"]:
            out[r["layer"]][r["format"]] = r
    return dict(sorted(out.items()))


def ranked_formats(worst: dict[str, Row]) -> list[tuple[str, Row]]:
    """One layer's formats, best first: by their worst SQNR (highest first)."""
    return sorted(worst.items(), key=lambda kv: -kv[1]["sqnr_db"])


def short_axis_count(table: list[Row]) -> int:
    """Rows whose block axis is shorter than one block (zero-padded blocks; marked, kept)."""
    return sum(1 for r in table if r.get("short_axis"))
