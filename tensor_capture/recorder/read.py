"""Reading a flight recorder's output: its summaries, triggers and replay files.

Why here: diagnosis and the report (tensor_viz) read what the recorder wrote, and must not
re-spell its layout (schema.RECORDER_*); this module imports neither torch nor the recorder's
hot path. The ring of a trigger and the full capture after it are ordinary manifest records in
the capture folder (schema.read_manifest / tensor_viz.columnar read them as any capture).

Layout (docs/capture.md "Recorder mode")::

    <save_dir>/manifest_rank<r>.jsonl                    ring dumps + triggered full capture
    <save_dir>/<tensor files>.pt                         the triggered capture's tensors
    <save_dir>/recorder/summary_rank<r>_it<first>.parquet  iteration x site rows, per K its
    <save_dir>/recorder/triggers_rank<r>.jsonl           one line per agreed trigger
    <save_dir>/recorder/loss_rank<r>.jsonl               one line per iteration with a loss
    <save_dir>/recorder/replay_it<T>.json (+ .yaml)      how to replay trigger T
    <save_dir>/replay_it<T>/capture/                     where that replay captures
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

from .. import schema

__all__ = ["recorder_dir", "is_recorder_output", "summary_files", "read_summaries",
           "summary_rows", "moments", "derived", "read_triggers", "read_replays",
           "trigger_iterations", "read_losses", "register_duckdb"]


def recorder_dir(folder: str | os.PathLike[str]) -> Path | None:
    """The recorder folder of a capture folder (``<folder>/recorder``), or ``folder`` itself
    when it is one; None when neither holds recorder output."""
    p = Path(folder)
    for cand in (p / schema.RECORDER_DIR, p):
        if cand.is_dir() and any(any(cand.glob(g)) for g in (
                schema.RECORDER_SUMMARY_GLOB, schema.RECORDER_TRIGGERS_GLOB)):
            return cand
    return None


def is_recorder_output(folder: str | os.PathLike[str]) -> bool:
    return recorder_dir(folder) is not None


def summary_files(folder: str | os.PathLike[str]) -> list[Path]:
    """Every rank's summary files, sorted by name (rank, then first iteration), rollup tiers
    included; a file whose iterations a coarser tier's file of its rank covers is left out
    (a writer stopped between writing the tier file and removing the finer ones)."""
    d = recorder_dir(folder)
    if d is None:
        return []
    named = [(p, schema.RECORDER_TIER_RE.search(p.name))
             for p in sorted(d.glob(schema.RECORDER_SUMMARY_GLOB))]
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for _, m in named:
        if m is not None and m["tier"] is not None:
            spans.setdefault(m["rank"], []).append((int(m["tier"]), int(m["first"]),
                                                    int(m["last"])))
    return [p for p, m in named if m is None or not any(
        tier > int(m["tier"] or 0) and first <= int(m["first"]) <= last
        for tier, first, last in spans.get(m["rank"], ()))]


def read_summaries(folder: str | os.PathLike[str], columns: Iterable[str] | None = None):
    """All summary rows as one pyarrow Table (columns schema.REC_SUMMARY_COLUMNS: iteration,
    rank, the site in first-seen = execution order and its naming fields, micro_batches merged,
    count and schema.REC_STATS); an empty table with those columns when there is none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = list(columns) if columns is not None else list(schema.REC_SUMMARY_COLUMNS)
    files = summary_files(folder)
    if not files:
        return pa.table({c: pa.array([], type=pa.null()) for c in cols})
    tables = [pq.read_table(f, columns=cols) for f in files]
    return pa.concat_tables(tables, promote_options="permissive")


def moments(count: float, nan_count: float, inf_count: float, total: float,
            sumsq: float) -> tuple[float, float]:
    """(mean, std) over the finite elements from the mergeable sums (sample std, n - 1; NaN
    when undefined): the one definition the ring's records and the readers use."""
    n = count - nan_count - inf_count
    if n <= 0:
        return math.nan, math.nan
    mean = total / n
    if n < 2:
        return mean, 0.0
    var = (sumsq - n * mean * mean) / (n - 1)
    return mean, math.sqrt(max(var, 0.0))


def derived(row: dict[str, Any]) -> dict[str, Any]:
    """A summary row's derived numbers: mean, std, absmax, nonfinite count, flush-to-zero and
    saturation ratios (of the elements)."""
    mean, std = moments(row["count"], row["nan_count"], row["inf_count"], row["sum"],
                        row["sumsq"])
    lo, hi = row["min"], row["max"]
    n = max(row["count"], 1)
    return {"mean": mean, "std": std,
            "absmax": max(abs(lo), abs(hi)) if math.isfinite(lo) and math.isfinite(hi) else
            math.nan,
            "nonfinite_count": row["nan_count"] + row["inf_count"],
            "flush_ratio": row["flush_count"] / n, "saturation_ratio": row["saturation_count"] / n}


def summary_rows(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every summary row as a dict with its :func:`derived` numbers, sorted by (iteration,
    rank, site)."""
    rows = read_summaries(folder).to_pylist()
    out = [{**r, **derived(r)} for r in rows]
    out.sort(key=lambda r: (r["iteration"], r["rank"], r["site"]))
    return out


def read_triggers(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank's trigger records (the keys Recorder's trigger writes), by (iteration, rank)."""
    d = recorder_dir(folder)
    if d is None:
        return []
    recs = list(schema.read_json_lines(sorted(d.glob(schema.RECORDER_TRIGGERS_GLOB))))
    recs.sort(key=lambda r: (r.get("iteration", -1), r.get("rank", -1)))
    return recs


def trigger_iterations(folder: str | os.PathLike[str]) -> list[int]:
    """The iterations at which the ranks agreed on a trigger."""
    return sorted({r["iteration"] for r in read_triggers(folder) if "iteration" in r})


def read_losses(folder: str | os.PathLike[str]) -> list[tuple[int, float]]:
    """The run's loss by iteration as the recorder saw it: (iteration, loss), sorted, the mean
    over the ranks that saw one (data-parallel ranks each see their own micro-batches' loss; the
    run's loss is their mean); a later line of the same rank and iteration (a resumed run)
    replaces an earlier one. Empty when the folder holds none."""
    d = recorder_dir(folder)
    if d is None:
        return []
    per_rank: dict[tuple[Any, int], float] = {}
    for rec in schema.read_json_lines(sorted(d.glob(schema.RECORDER_LOSS_GLOB))):
        if isinstance(rec.get("loss"), (int, float)) and isinstance(rec.get("iteration"), int):
            per_rank[(rec.get("rank"), rec["iteration"])] = float(rec["loss"])
    by_it: dict[int, list[float]] = {}
    for (_, it), v in per_rank.items():
        by_it.setdefault(it, []).append(v)
    return [(it, sum(vs) / len(vs)) for it, vs in sorted(by_it.items())]


def read_replays(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every replay file's content (plus ``path``), by iteration."""
    d = recorder_dir(folder)
    if d is None:
        return []
    out = []
    for path in sorted(d.glob(schema.RECORDER_REPLAY_GLOB)):
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict):
            out.append({**rec, "path": str(path)})
    return out


def register_duckdb(con: Any, folder: str | os.PathLike[str],
                    name: str = "recorder_summary") -> str | None:
    """A DuckDB view ``name`` over the folder's summary files (None when there are none)."""
    files = summary_files(folder)
    if not files:
        return None
    listing = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
    con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM read_parquet([{listing}], "
                "union_by_name = true)")
    return name
