"""OUT/numerics.csv: the what-if numerics capture stored, one row per (tensor, what-if format).

Why a CSV: a run's quantization error per layer, tensor, iteration and format is the table
researchers load into their own notebooks; the figures draw a subset, this file holds it all.
The rows are tensor_viz.numerics_data's table: each record's ``metadata["whatif"]``, computed at
capture along the GEMM's reduction axis (``source`` "capture"), and the numbers capture did not
store, recomputed by the report from saved tensors by capture's own computation on the same
``axis`` (``source`` "recomputed"). ``short_axis`` marks a block format on a tensor whose block axis is shorter than one block
(true/false; empty for formats without blocks): its block numbers describe zero-padded blocks.
"""
from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any, Iterable

from lowp_common import atomic_write_text
from tensor_viz import numerics_data
from tensor_viz.catalog import Entry

FILE_NAME = "numerics.csv"
NAME_COLUMNS = numerics_data.NAME_FIELDS
NUMBER_COLUMNS = numerics_data.NUMBER_FIELDS
#: block_scale key -> column (empty for formats without block scales)
BLOCK_COLUMNS = {"min": "block_scale_min", "max": "block_scale_max", "std": "block_scale_std"}
COLUMNS = (("file",) + NAME_COLUMNS + ("format",) + NUMBER_COLUMNS + tuple(BLOCK_COLUMNS.values())
           + ("axis", "source", "short_axis"))


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return v


def rows(entries: Iterable[Entry], table: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One dict per (entry, what-if format), keys COLUMNS (``table``: numerics_data.rows of the
    entries, when already built); a format that failed at capture keeps its row with empty
    numbers."""
    table = numerics_data.rows(entries) if table is None else table
    return [{k: _cell(r.get(k)) for k in COLUMNS} for r in table]


def write_csv(entries: Iterable[Entry], out_dir: str | os.PathLike[str],
              table: list[dict[str, Any]] | None = None) -> str | None:
    """Write OUT/numerics.csv atomically; returns its name, or None when no entry has what-if
    numbers (no file, so an empty table is never mistaken for a clean run)."""
    out = rows(entries, table)
    if not out:
        return None
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(out)
    atomic_write_text(Path(out_dir) / FILE_NAME, buf.getvalue())
    return FILE_NAME
