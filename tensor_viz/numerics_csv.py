"""OUT/numerics.csv: the what-if numerics capture stored, one row per (tensor, what-if format).

Why a CSV: a run's quantization error per layer, tensor, iteration and format is the table
researchers load into their own notebooks; the figures draw a subset, this file holds it all.
Values come from each record's ``metadata["whatif"]`` (tensor_capture.whatif, computed at
capture along the GEMM's reduction axis). A capture made before that key existed has its saved
tensors recomputed with quant.whatif along the last axis (on the rows the file kept), at most
``FALLBACK_MAX_FILES`` files.
"""
from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any, Iterable

from lowp_common import atomic_write_text
from tensor_capture import schema
from tensor_viz.catalog import Entry

FILE_NAME = "numerics.csv"
NAME_COLUMNS = ("layer_type", "layer_idx", "operation", "phase", "component", "tensor_name",
                "iteration", "rank")
NUMBER_COLUMNS = ("sqnr_db", "rel_error", "overflow_ratio", "underflow_ratio", "flush_ratio")
#: block_scale key -> column (empty for formats without block scales)
BLOCK_COLUMNS = {"min": "block_scale_min", "max": "block_scale_max", "std": "block_scale_std"}
COLUMNS = ("file",) + NAME_COLUMNS + ("format",) + NUMBER_COLUMNS + tuple(BLOCK_COLUMNS.values())
FALLBACK_MAX_FILES = 200


def _fallback(entry: Entry) -> dict[str, Any] | None:
    """What-if numbers of a saved tensor whose catalog entry lacks them: from the file's own
    metadata, else computed (an older capture)."""
    try:
        from quant.formats import WHATIF_FORMATS
        from quant.whatif import whatif_set

        tensor, meta = schema.load_tensor_file(entry.path)
        stored = meta.get(schema.META_WHATIF)
        if isinstance(stored, dict) and isinstance(stored.get(schema.WHATIF_FORMATS), dict):
            return stored                  # a file found without its manifest
        if tensor.numel() == 0 or not tensor.is_floating_point():
            return None
        return {schema.WHATIF_FORMATS: whatif_set(tensor, WHATIF_FORMATS, -1)}
    except (ImportError, ValueError):
        return None


def _numbers(entry: Entry, budget: list[int]) -> dict[str, Any] | None:
    stored = entry.meta.get(schema.META_WHATIF)
    if isinstance(stored, dict) and isinstance(stored.get(schema.WHATIF_FORMATS), dict):
        return stored[schema.WHATIF_FORMATS]
    if entry.path and entry.variant == schema.VARIANT_HP and budget[0] > 0:
        budget[0] -= 1
        computed = _fallback(entry)
        if computed is not None:
            return computed[schema.WHATIF_FORMATS]
    return None


def rows(entries: Iterable[Entry]) -> list[dict[str, Any]]:
    """One dict per (entry, what-if format), keys COLUMNS; a format that failed at capture
    keeps its row with empty numbers."""
    out: list[dict[str, Any]] = []
    budget = [FALLBACK_MAX_FILES]
    for e in entries:
        formats = _numbers(e, budget)
        if not formats:
            continue
        base = {"file": os.path.basename(e.path) if e.path else "",
                **{k: getattr(e.name, k) for k in NAME_COLUMNS}}
        for fmt, num in formats.items():
            num = num if isinstance(num, dict) else {}
            row = dict(base, format=fmt)
            row.update({k: num.get(k, "") for k in NUMBER_COLUMNS})
            scale = num.get("block_scale") if isinstance(num.get("block_scale"), dict) else {}
            row.update({col: ("" if scale.get(k) is None else scale[k])
                        for k, col in BLOCK_COLUMNS.items()})
            out.append(row)
    return out


def write_csv(entries: Iterable[Entry], out_dir: str | os.PathLike[str]) -> str | None:
    """Write OUT/numerics.csv atomically; returns its name, or None when no entry has what-if
    numbers (no file, so an empty table is never mistaken for a clean run)."""
    table = rows(entries)
    if not table:
        return None
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in table:
        w.writerow({k: ("" if r[k] is None else r[k]) for k in COLUMNS})
    atomic_write_text(Path(out_dir) / FILE_NAME, buf.getvalue())
    return FILE_NAME
