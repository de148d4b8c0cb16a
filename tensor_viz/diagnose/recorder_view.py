"""A flight recorder's summaries as rows diagnosis and the report read (tensor_capture.recorder.flight).

Why here: the recorder writes one summary row per iteration x site (micro-batches merged) for the
whole run, and ordinary manifest records only around a trigger (the ring before it, the full
capture after it). Diagnosis must see both: the records where they exist (micro-batch detail),
the summaries everywhere else (iteration granularity), so a NaN is found at the iteration the
summaries first show it and named down to the micro-batch by the ring, and a drift is seen over
the whole run. This module turns summary rows into rows of diagnosis' narrow table
(tensor_viz.diagnose.rules.NARROW) with the same column names, and reads the timeline the
report draws. The layout is tensor_capture.recorder.read's (docs/capture.md "Recorder mode").
"""
from __future__ import annotations

import math
import os
from typing import Any

from tensor_capture.recorder import read as recorder_read

#: the view of the summary files on a DuckDB connection
SUMMARY_VIEW = "recorder_summary"


def has_summaries(folder: str | os.PathLike[str]) -> bool:
    return bool(recorder_read.summary_files(folder))


def max_normal_of(names: set[str]) -> dict[str, float]:
    """Each label's largest normal value as capture's records give it (tensor_capture.stats
    .format_range: an unscaled format or dtype label such as bf16; a scaled format such as mxfp8
    has none, its raw values are not compared with the element range). Names without one are
    left out: range_drift then has no bound for them, as for their records."""
    from tensor_capture.stats import format_range

    out = {}
    for name in names:
        spec = format_range(name)
        if spec is not None:
            out[name] = float(spec.max_normal)
    return out


def _bounds_sql(bounds: dict[str, float]) -> str:
    """A CASE expression: quant_type -> its largest normal value (NULL when unknown)."""
    if not bounds:
        return "CAST(NULL AS DOUBLE)"
    arms = " ".join(f"WHEN quant_type = '{k.replace(chr(39), chr(39) * 2)}' THEN {v!r}"
                    for k, v in sorted(bounds.items()) if math.isfinite(v))
    return f"CASE {arms} ELSE CAST(NULL AS DOUBLE) END" if arms else "CAST(NULL AS DOUBLE)"


def _narrow_select(view: str, bounds: dict[str, float]) -> str:
    """SELECT of summary rows in the narrow table's columns (tensor_viz.diagnose.rules.materialize):
    the moments from the mergeable sums (recorder_read.moments, here in SQL), sample_idx NULL
    (micro-batches merged), counter = the site's first-seen (execution) order."""
    n = "(count - nan_count - inf_count)"
    mean = f"CASE WHEN {n} > 0 THEN sum / {n} END"
    var = f"CASE WHEN {n} > 1 THEN greatest((sumsq - {n} * ({mean}) * ({mean})) / ({n} - 1), 0) END"
    return f"""SELECT CAST(rank AS BIGINT) AS rank, CAST(iteration AS BIGINT) AS iteration,
        CAST(NULL AS BIGINT) AS sample_idx, CAST(site AS BIGINT) AS counter,
        CAST(layer_idx AS BIGINT) AS layer_idx, module_path, operation, phase, tensor_name,
        quant_type, CAST(NULL AS STRING) AS emulated_format,
        coalesce(variant, 'hp') AS variant, CAST(NULL AS BIGINT) AS last_dim,
        CASE WHEN isfinite("min") AND isfinite("max") THEN greatest(abs("min"), abs("max")) END
            AS absmax,
        CASE WHEN {n} = 1 THEN 0.0 ELSE sqrt({var}) END AS std, {mean} AS mean,
        CAST(count AS BIGINT) AS numel,
        CAST(nan_count AS BIGINT) AS nan_count, CAST(inf_count AS BIGINT) AS inf_count,
        {_bounds_sql(bounds)} AS max_normal,
        flush_count / greatest(count, 1) AS flush,
        saturation_count / greatest(count, 1) AS overflow,
        CAST(NULL AS DOUBLE) AS underflow,
        false AS has_whatif
        FROM {view}"""


def _view(con: Any, folder: str | os.PathLike[str]) -> str | None:
    view = recorder_read.register_duckdb(con, folder, SUMMARY_VIEW)
    return view


def _bounds(con: Any, view: str) -> dict[str, float]:
    names = {r[0] for r in con.execute(f"SELECT DISTINCT quant_type FROM {view}").fetchall()
             if r[0]}
    return max_normal_of(names)


def add_summaries(con: Any, narrow: str, folder: str | os.PathLike[str]) -> int:
    """Append to ``narrow`` the summary rows of every (rank, iteration) that no record there
    covers (records are finer: micro-batch detail); returns how many rows were added."""
    view = _view(con, folder)
    if view is None:
        return 0
    before = con.execute(f"SELECT count(*) FROM {narrow}").fetchone()[0]
    con.execute(f"""INSERT INTO {narrow} BY NAME
        SELECT s.* FROM ({_narrow_select(view, _bounds(con, view))}) AS s
        WHERE NOT EXISTS (SELECT 1 FROM {narrow} AS r
                          WHERE r.rank = s.rank AND r.iteration = s.iteration)""")
    return con.execute(f"SELECT count(*) FROM {narrow}").fetchone()[0] - before


def narrow_from_summaries(con: Any, narrow: str, folder: str | os.PathLike[str]) -> int:
    """Create ``narrow`` from the summaries alone (a recorder run that never triggered wrote no
    record); returns its row count.

    A table, not a view over the files: rank_outlier's medians over ranks need the rows more
    than once, and over a view of 20 M rows they ran out of memory (1.5 GB limit) where the
    table, held by DuckDB's buffer manager and spilled beyond its memory_limit
    (columnar.connect), stays bounded: 1.36 GiB at 5.2 M rows, 1.55 GiB at 20.7 M
    (bench/bench_recorder_scale.py)."""
    view = _view(con, folder)
    if view is None:
        return 0
    con.execute(f"CREATE OR REPLACE TEMP TABLE {narrow} AS "
                f"{_narrow_select(view, _bounds(con, view))}")
    return con.execute(f"SELECT count(*) FROM {narrow}").fetchone()[0]


def triggers_text(folder: str | os.PathLike[str]) -> str | None:
    """The triggers the ranks agreed on, in one phrase (None when there was none)."""
    by_it: dict[int, set[str]] = {}
    for rec in recorder_read.read_triggers(folder):
        if "iteration" in rec:
            by_it.setdefault(rec["iteration"], set()).update(rec.get("kinds") or ())
    if not by_it:
        return None
    return "; ".join(f"iteration {it}: {', '.join(sorted(k)) or 'trigger'}"
                     for it, k in sorted(by_it.items()))


def timeline(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The run's timeline from the summaries, per layer (ranks and the layer's sites merged):
    {"iterations": [...], "layers": {label: {"absmax": [...], "flush_ratio": [...],
    "nonfinite": [...]}}, "triggers": [{"iteration", "kinds"}]}. Empty lists when the folder
    holds no summary."""
    rows = recorder_read.summary_rows(folder)
    its = sorted({r["iteration"] for r in rows})
    index = {it: i for i, it in enumerate(its)}
    layers: dict[str, dict[str, list[float]]] = {}
    flush_n: dict[str, list[float]] = {}
    for r in rows:
        label = _layer_label(r)
        cur = layers.setdefault(label, {"absmax": [math.nan] * len(its),
                                        "flush_ratio": [0.0] * len(its),
                                        "nonfinite": [0.0] * len(its)})
        counts = flush_n.setdefault(label, [0.0] * len(its))
        i = index[r["iteration"]]
        a = r["absmax"]
        if a is not None and math.isfinite(a):
            cur["absmax"][i] = a if math.isnan(cur["absmax"][i]) else max(cur["absmax"][i], a)
        cur["nonfinite"][i] += r["nonfinite_count"]
        cur["flush_ratio"][i] += r["flush_count"]
        counts[i] += r["count"]
    for label, cur in layers.items():
        cur["flush_ratio"] = [f / n if n else 0.0 for f, n in zip(cur["flush_ratio"],
                                                                 flush_n[label])]
    trig: dict[int, set[str]] = {}
    for rec in recorder_read.read_triggers(folder):
        if "iteration" in rec:
            trig.setdefault(rec["iteration"], set()).update(rec.get("kinds") or ())
    return {"iterations": its, "layers": dict(sorted(layers.items(), key=lambda kv: _order(kv[0]))),
            "triggers": [{"iteration": it, "kinds": sorted(k)} for it, k in sorted(trig.items())]}


def _layer_label(row: dict[str, Any]) -> str:
    idx = row.get("layer_idx")
    return f"layer {idx}" if idx is not None else "outside the layers"


def _order(label: str) -> tuple[int, int]:
    parts = label.split()
    return (0, int(parts[1])) if len(parts) == 2 and parts[1].isdigit() else (1, 0)
