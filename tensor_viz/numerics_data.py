"""What-if numerics of a run as one long table, and the report's aggregations over it.

Why a table of plain dicts: numerics.csv, the numerics figures (plots_numerics), the interactive
view and the summary table all read the same rows, one per (captured tensor, what-if format),
built once per report from the catalog's records (``metadata["whatif"]``, tensor_capture.whatif).
Each aggregation below is a small function over those rows, so a query engine can replace any of
them without touching the figures.

A capture made before the ``whatif`` key existed has its saved high-precision tensors recomputed
with quant.whatif along the last axis (``source`` "recomputed"), at most ``FALLBACK_MAX_FILES``,
each on at most the capture's ``WHATIF_MAX_ELEMENTS`` (strided whole rows, ``sampled``).
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any, Iterable

from quant.whatif_record import SCALAR_KEYS
from tensor_capture import schema
from tensor_viz.catalog import Entry

#: naming fields copied from each record into every row
NAME_FIELDS = ("layer_type", "layer_idx", "operation", "phase", "component", "tensor_name",
               "iteration", "rank")
#: quant.whatif's numbers, over all elements
NUMBER_FIELDS = SCALAR_KEYS
FALLBACK_MAX_FILES = 200
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


def _fallback(entry: Entry) -> dict[str, Any] | None:
    """What-if numbers of a saved tensor whose record lacks them: from the file's own metadata
    (a file found without its manifest), else computed along the last axis (an older capture)."""
    try:
        from quant.formats import WHATIF_FORMATS
        from quant.whatif import whatif_set
        from tensor_capture.config import WHATIF_MAX_ELEMENTS
        from tensor_capture.whatif import sample

        tensor, meta = schema.load_tensor_file(entry.path)
        stored = meta.get(schema.META_WHATIF)
        if isinstance(stored, dict) and isinstance(stored.get(schema.WHATIF_FORMATS), dict):
            return dict(stored, source=SOURCE_CAPTURE)
        if tensor.numel() == 0 or not tensor.is_floating_point():
            return None
        # the capture's own bound: a strided subset of whole rows above WHATIF_MAX_ELEMENTS
        part = sample(tensor, -1, WHATIF_MAX_ELEMENTS)
        return {schema.WHATIF_AXIS: -1, schema.WHATIF_SAMPLED: part.numel() < tensor.numel(),
                "source": SOURCE_RECOMPUTED,
                schema.WHATIF_FORMATS: whatif_set(part, WHATIF_FORMATS, -1)}
    except (ImportError, ValueError, OSError):
        return None


def _whatif_of(entry: Entry, budget: list[int]) -> dict[str, Any] | None:
    stored = entry.meta.get(schema.META_WHATIF)
    if isinstance(stored, dict) and isinstance(stored.get(schema.WHATIF_FORMATS), dict):
        return dict(stored, source=SOURCE_CAPTURE)
    if entry.path and entry.variant == schema.VARIANT_HP and budget[0] > 0:
        budget[0] -= 1
        return _fallback(entry)
    return None


def rows(entries: Iterable[Entry]) -> list[Row]:
    """One row per (entry, what-if format): the naming fields, ``file`` (basename, '' for a
    stats-only record), ``label`` / ``layer`` (the report's tensor and layer names),
    ``quant_type``, ``format``, the numbers (None where the format failed at capture), the block
    scale (``block_scale_min/max/std``, ``scale_kind``, ``scale_hist``), ``short_axis`` (None
    for formats without blocks), ``sampled`` and ``source``."""
    out: list[Row] = []
    budget = [FALLBACK_MAX_FILES]
    for e in entries:
        w = _whatif_of(e, budget)
        if not w:
            continue
        base = {"file": os.path.basename(e.path) if e.path else "",
                **{k: getattr(e.name, k) for k in NAME_FIELDS},
                "label": e.label, "layer": e.layer_label, "quant_type": e.name.quant_type,
                "sampled": bool(w.get(schema.WHATIF_SAMPLED)), "source": w.get("source"),
                # for the format's Gaussian baseline (quant.format_loss): the same shape and axis
                "shape": e.meta.get(schema.META_SHAPE), "axis": w.get(schema.WHATIF_AXIS)}
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
