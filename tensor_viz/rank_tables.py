"""Aggregations over the columnar index (tensor_viz.columnar), run by DuckDB.

Why here: a cluster capture holds millions of records; these queries return only aggregates
(a header, a bounded table of outlier ranks, per-iteration counts), and numerics.csv is written by
the engine itself, so the report's memory does not grow with the number of records.

The cross-rank question ("which rank diverged, from which iteration"): per layer x tensor x
iteration, each rank's value of a metric (:data:`METRICS`, the micro-batches of a rank folded by
the metric's own fold), its min / median / max across ranks, and the ranks whose robust z-score
``|v - median| / scale`` exceeds :data:`OUTLIER_Z`, where ``scale`` is 1.4826 x the median
absolute deviation, floored at :data:`REL_FLOOR` x |median| (so ranks that agree to the last digit
are not outliers of each other) -- the one definition of a rank outlier.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensor_capture import schema
from tensor_capture.stats_read import merged_std_sql
from tensor_viz.columnar import SQL_HP, IndexState, sql_string
from tensor_viz.diagnose.sql_dialect import dialect, engine, named_struct

#: robust z-score above which a rank is an outlier of its layer x tensor x iteration
OUTLIER_Z = 3.5
#: the deviation scale never falls below this share of |median|
REL_FLOOR = 0.05
#: metric -> (SQL over one record of the index, the same number in diagnosis' narrow table
#: (tensor_viz.diagnose.rules.NARROW: flat columns, also filled from a flight recorder's
#: summaries), how a rank's micro-batches fold: an aggregate, or "merge": the std of their union
#: from counts, means and stds, tensor_capture.stats_read); ratios are of the tensor's own quant
#: type (stats.range), as the overflow table reads them
METRICS: dict[str, tuple[str, str, str]] = {
    "absmax": ("stats.absmax", "absmax", "max"),
    "std": ("stats.std", "std", "merge"),        # the std of the rank's micro-batches together
    "underflow_ratio": ("stats.range[quant_type].underflow_ratio", "underflow", "max"),
    "overflow_ratio": ("stats.range[quant_type].overflow_ratio", "overflow", "max"),
    "flush_ratio": ("stats.range[quant_type].flush_to_zero_ratio", "flush", "max"),
    "nonfinite": ("stats.nan_count + stats.inf_count", "nan_count + inf_count", "max"),
}
#: the cells of the test: layer x tensor (the index names the submodule; the narrow table the
#: module path, which a recorder's summaries also carry)
_KEY = ("layer_idx", "submodule", "operation", "phase", "tensor_name")
_NARROW_KEY = ("layer_idx", "module_path", "operation", "phase", "tensor_name")


@dataclass
class Header:
    """What the report's header states about the capture."""

    records: int
    ranks: int
    iterations: int
    first_iteration: int | None
    last_iteration: int | None
    bad_lines: int
    bad_examples: list[str] = field(default_factory=list)
    pending_bytes: int = 0
    manifests: int = 0

    def line(self) -> str:
        its = ("" if self.first_iteration is None
               else f" ({self.first_iteration}..{self.last_iteration})")
        text = (f"{self.records:,} records from {self.manifests} manifest(s): {self.ranks} rank(s), "
                f"{self.iterations} iteration(s){its}; {self.bad_lines:,} bad line(s) skipped")
        if self.bad_examples:
            text += " (" + "; ".join(self.bad_examples[:3]) + ")"
        if self.pending_bytes:
            text += f"; {self.pending_bytes:,} bytes of unfinished lines wait for the next report"
        return text


def _source(state: IndexState) -> str:
    # a state may name a table holding the same columns (tensor_viz.diagnose.rules' narrow copy
    # of the index, so the outlier test reads flat columns instead of the nested Parquet)
    relation = getattr(state, "relation", None)
    if relation:
        return relation
    return f"read_parquet({sql_string(state.parquet_glob)}, hive_partitioning=true, union_by_name=true)"


def header(con: Any, state: IndexState) -> Header:
    if state.records == 0:
        return Header(0, 0, 0, None, None, state.bad_lines, state.bad_examples,
                      state.pending_bytes, state.manifests)
    n, ranks, its, lo, hi = con.execute(
        f"SELECT count(*), count(DISTINCT rank), count(DISTINCT iteration), min(iteration), "
        f"max(iteration) FROM {_source(state)}").fetchone()
    return Header(int(n), int(ranks), int(its), lo, hi, state.bad_lines, state.bad_examples,
                  state.pending_bytes, state.manifests)


def _key(state: IndexState) -> tuple[str, ...]:
    return _NARROW_KEY if getattr(state, "relation", None) else _KEY


def _value_sql(metric: str, narrow: bool) -> tuple[str, str, str]:
    """(``n``, ``mean``, the metric's value) as SQL over one row of the source, as DOUBLE."""
    nested, flat, _ = METRICS[metric]
    n, m = ("numel", "mean") if narrow else ("stats.numel", "stats.mean")
    return (f"CAST({n} AS DOUBLE)", f"CAST({m} AS DOUBLE)",
            f"CAST({flat if narrow else nested} AS DOUBLE)")


def _fold_sql(metric: str, narrow: bool) -> str:
    """The aggregate folding a rank's rows of one cell x iteration into the metric's value
    (NULL when no row has a finite value: that rank is not counted in the cell)."""
    n, m, v = _value_sql(metric, narrow)
    if METRICS[metric][2] == "merge":
        counted = f"(CASE WHEN {n} > 0 AND isfinite({m}) AND isfinite({v}) THEN {n} END)"
        return merged_std_sql(counted, m, v)
    return f"{METRICS[metric][2]}(CASE WHEN isfinite({v}) THEN {v} END)"


def _z_expr(v: str, med: str, mad: str) -> str:
    """The robust z of the module docstring (one definition for every query shape)."""
    return f"abs({v} - {med}) / greatest(1.4826 * {mad}, {REL_FLOOR} * abs({med}), 1e-30)"


def _per_rank_sql(state: IndexState, metric: str, hashed: bool = False) -> str:
    """One metric's value per cell x iteration x rank (``metric``, the cell's columns or its hash
    ``cell``, ``iteration``, ``rank``, ``v``)."""
    narrow = bool(getattr(state, "relation", None))
    key = ", ".join(_key(state))
    # hashed: the cell's columns as one integer ``cell`` (grouping on strings is the cost)
    inner, key = (f"hash({key}) AS cell, *", "cell") if hashed else ("*", key)
    return f"""
        SELECT '{metric}' AS metric, {key}, iteration, rank, v FROM (
            SELECT {key}, iteration, rank, {_fold_sql(metric, narrow)} AS v FROM (
                SELECT {inner} FROM {_source(state)}
                WHERE coalesce(variant, {SQL_HP}) = {SQL_HP}) AS x
            GROUP BY {key}, iteration, rank) AS y
        WHERE v IS NOT NULL"""


def _z_sql(per_rank: str, key: str) -> str:
    """Each row of ``per_rank`` (``key`` columns, iteration, rank, v) with its cell's median,
    min, max, rank count and the rank's robust z (the module docstring's definition); windows
    over the cell, not joins, so a cell with a NULL column (the output layer has no layer index)
    is scored like any other."""
    return f"""
        WITH d AS (SELECT r.*, median(v) OVER p AS med, min(v) OVER p AS lo,
                          max(v) OVER p AS hi, count(*) OVER p AS ranks
                   FROM ({per_rank}) AS r WINDOW p AS (PARTITION BY {key}, iteration))
        SELECT d.*, {_z_expr("v", "med", "median(abs(v - med)) OVER p")} AS z
        FROM d WINDOW p AS (PARTITION BY {key}, iteration)"""


def _scored_sql(state: IndexState, metrics: list[str]) -> str:
    """Each rank's z per metric x layer x tensor x iteration cell."""
    per_rank = " UNION ALL ".join(f"({_per_rank_sql(state, m)})" for m in metrics)
    return _z_sql(per_rank, ", ".join(("metric", *_key(state))))


#: rows of one metric's per-rank values scored together on DuckDB (an iteration range at a time)
CHUNK_ROWS = 2_000_000


def _cells_table(con: Any, state: IndexState) -> None:
    """``_rank_cells``: each cell's hash (the engine's ``hash``) and its columns, so outliers
    scored on hashes get their names back."""
    cols = ", ".join(_key(state))
    con.execute(f"""CREATE OR REPLACE TEMP TABLE _rank_cells AS
        SELECT {dialect(con)["hash"]}({cols}) AS cell, {cols} FROM {_source(state)}
        GROUP BY {cols}""")


def _named(metric_sql: str) -> str:
    return f"""(SELECT {metric_sql} AS metric, c.*, o.iteration, o.rank, o.v, o.med, o.z
        FROM _rank_outliers o JOIN _rank_cells c USING (cell))"""


def _outlier_cells_duckdb(con: Any, state: IndexState, metric: str) -> str:
    """A temp table of one metric's outlier cells (the columns ``_scored_sql`` gives, for rows
    with z above OUTLIER_Z), scored an iteration range at a time: the medians of a range fit in
    memory, where all of them at once spill (20.7 M summary rows: 118 s for one metric, 4.5 s
    in ranges). A cell is keyed by the hash of its layer x tensor columns while scored, the names
    joined back to the few outlier rows."""
    con.execute(f"""CREATE OR REPLACE TEMP TABLE _rank_values AS
        SELECT cell, iteration, rank, v
        FROM ({_per_rank_sql(state, metric, hashed=True)}) ORDER BY iteration""")
    _cells_table(con, state)
    lo, hi, n = con.execute("SELECT min(iteration), max(iteration), count(*) "
                            "FROM _rank_values").fetchone()
    con.execute("""CREATE OR REPLACE TEMP TABLE _rank_outliers (cell UBIGINT, iteration BIGINT,
        rank BIGINT, v DOUBLE, med DOUBLE, z DOUBLE)""")
    if n:
        width = max(1, -(-(hi - lo + 1) * CHUNK_ROWS // n))
        for first in range(lo, hi + 1, width):
            scored = _z_sql(f"SELECT * FROM _rank_values WHERE iteration >= {first} "
                            f"AND iteration < {first + width}", "cell")
            con.execute(f"""INSERT INTO _rank_outliers SELECT cell, iteration, rank, v, med, z
                FROM ({scored}) WHERE ranks >= 3 AND z > {OUTLIER_Z}""")
    return _named(f"'{metric}'")


def _outlier_cells_wide(con: Any, state: IndexState, metrics: list[str]) -> str:
    """Every metric's outlier cells in one pass (Spark): one row per cell x iteration x rank
    with a column per metric, the medians and deviations as windows over the cell, then one row
    per metric. One shuffle of the rows instead of one per metric and join (0.52 M summary rows:
    12 s, against 59 s for the union of per-metric joins)."""
    narrow = bool(getattr(state, "relation", None))
    cols, spell = ", ".join(_key(state)), dialect(con)
    folds = ", ".join(f"{_fold_sql(m, narrow)} AS v_{m}" for m in metrics)
    meds = ", ".join(f"median(v_{m}) OVER p AS med_{m}, count(v_{m}) OVER p AS n_{m}"
                     for m in metrics)
    zs = ", ".join(f"{_z_expr(f'v_{m}', f'med_{m}', f'median(abs(v_{m} - med_{m})) OVER p')}"
                   f" AS z_{m}" for m in metrics)
    rows = ", ".join(named_struct(con, {"metric": f"'{m}'", "v": f"v_{m}", "med": f"med_{m}",
                                        "z": f"z_{m}", "ranks": f"n_{m}"}) for m in metrics)
    con.execute(f"""CREATE OR REPLACE TEMP TABLE _rank_outliers AS
        WITH r AS (SELECT cell, iteration, rank, {folds} FROM (
                SELECT {spell["hash"]}({cols}) AS cell, * FROM {_source(state)}
                WHERE coalesce(variant, {SQL_HP}) = {SQL_HP}) AS x
            GROUP BY cell, iteration, rank),
        d AS (SELECT r.*, {meds} FROM r WINDOW p AS (PARTITION BY cell, iteration)),
        z AS (SELECT d.*, {zs} FROM d WINDOW p AS (PARTITION BY cell, iteration)),
        s AS (SELECT cell, iteration, rank, {spell["explode"]}({spell["array"]}({rows})) AS o
              FROM z)
        SELECT cell, iteration, rank, o.metric AS metric, o.v AS v, o.med AS med, o.z AS z
        FROM s WHERE o.ranks >= 3 AND o.z > {OUTLIER_Z}""")
    _cells_table(con, state)
    return _named("o.metric")


def outlier_ranks(con: Any, state: IndexState, metric: str | None,
                  limit: int = 20) -> list[dict[str, Any]]:
    """Per metric (``None``: every metric of :data:`METRICS`) and rank with
    outliers: the first iteration it is one, how many layer x tensor x iteration cells, the
    worst z and where (only ranks of worlds of 3+ ranks can be judged); at most ``limit`` ranks
    per metric. The same SQL on DuckDB and Spark (tensor_viz.diagnose.sql_dialect spells the struct)."""
    if metric is None and engine(con) == "duckdb":
        # DuckDB: one metric at a time, so the medians hold one metric's cells (all six at once
        # ran out of memory at 20.7 M summary rows); Spark: every metric in one pass, spilled by
        # Spark itself
        return [row for name in METRICS for row in outlier_ranks(con, state, name, limit)]
    metrics = list(METRICS) if metric is None else [metric]
    key = _key(state)
    if engine(con) == "duckdb":
        outliers = _outlier_cells_duckdb(con, state, metrics[0])
    else:
        outliers = _outlier_cells_wide(con, state, metrics)
    worst = named_struct(con, {k: k for k in (*key, "iteration", "v", "med")})
    # ties of z broken alike on both engines (no NULL in the ordering: they sort differently)
    order = named_struct(con, {"z": "z", "i": "iteration", **{
        f"k{i}": f"coalesce(CAST({k} AS STRING), '')" for i, k in enumerate(key)}})
    rows = con.execute(f"""
        WITH o AS {outliers},
        g AS (SELECT metric, rank, min(iteration) AS first_iteration, count(*) AS cells,
                     max(z) AS worst_z, max_by({worst}, {order}) AS worst
              FROM o GROUP BY metric, rank),
        n AS (SELECT g.*, row_number() OVER (PARTITION BY metric
                  ORDER BY first_iteration, worst_z DESC, rank) AS k FROM g)
        SELECT metric, rank, first_iteration, cells, worst_z, worst, k FROM n
        WHERE k <= {int(limit)}""").fetchall()
    out = []
    for name, rank, first, cells, z, at, k in sorted(rows, key=lambda r: (
            metrics.index(r[0]), r[-1])):
        out.append({"metric": name, "rank": int(rank), "first_iteration": int(first),
                    "cells": int(cells), "worst_z": float(z), **at})
    return out


def band(con: Any, state: IndexState, metric: str, where: dict[str, Any], rank: int
         ) -> list[tuple[int, float, float, float, float | None]]:
    """(iteration, min, median, max across ranks, ``rank``'s value) of one layer x tensor."""
    key = _key(state)
    conds = " AND ".join(f"{k} IS NOT DISTINCT FROM ?" for k in key)
    rows = con.execute(f"""
        WITH r AS ({_per_rank_sql(state, metric)})
        SELECT iteration, min(v), median(v), max(v), max(v) FILTER (WHERE rank = ?)
        FROM r WHERE {conds} GROUP BY iteration ORDER BY iteration""",
        [rank] + [where.get(k) for k in key]).fetchall()
    return [(int(i), float(a), float(m), float(b), None if r is None else float(r))
            for i, a, m, b, r in rows]


def outliers_per_iteration(con: Any, state: IndexState, metric: str) -> list[tuple[int, int]]:
    """(iteration, outlier cells) for iterations that have any."""
    return [(int(i), int(n)) for i, n in con.execute(f"""
        WITH s AS ({_scored_sql(state, [metric])})
        SELECT iteration, count(*) FROM s WHERE ranks >= 3 AND z > {OUTLIER_Z}
        GROUP BY iteration ORDER BY iteration""").fetchall()]


def write_numerics_csv(con: Any, state: IndexState, out_dir: str | os.PathLike[str],
                       columns: tuple[str, ...]) -> int:
    """numerics.csv of every record's what-if numerics, written by the engine (one row per record
    and format, ``columns`` in order, as tensor_viz.numerics_csv names them; rows in the engine's
    order, not sorted); rows written."""
    from lowp_common import atomic_path

    fields = {
        "file": f"coalesce(regexp_extract(\"{schema.MANIFEST_FILE}\", '[^/]*$'), '')",
        "format": "f.key", "sqnr_db": "f.value.sqnr_db", "rel_error": "f.value.rel_error",
        "overflow_ratio": "f.value.overflow_ratio", "underflow_ratio": "f.value.underflow_ratio",
        "flush_ratio": "f.value.flush_ratio", "block_scale_min": "f.value.block_scale.min",
        "block_scale_max": "f.value.block_scale.max", "block_scale_std": "f.value.block_scale.std",
        "short_axis": "f.value.short_axis", "axis": "whatif.axis",
        "source": "'capture'",      # the index holds what capture stored; nothing recomputed
    }
    select = ", ".join(f"{fields.get(c, c)} AS \"{c}\"" for c in columns)
    total = con.execute(f"""SELECT count(*) FROM (SELECT unnest(map_entries(whatif.formats)) AS f
        FROM {_source(state)} WHERE whatif IS NOT NULL)""").fetchone()[0]
    if not total:
        return 0
    target = Path(out_dir) / "numerics.csv"
    with atomic_path(target) as tmp:
        con.execute(f"""COPY (SELECT {select} FROM (
                SELECT *, unnest(map_entries(whatif.formats)) AS f FROM {_source(state)}
                WHERE whatif IS NOT NULL))
            TO {sql_string(tmp)} (HEADER, DELIMITER ',')""")
    return int(total)


def selection(con: Any, state: IndexState, limit: int, keep_ranks: list[int] | None = None
              ) -> list[dict[str, Any]]:
    """At most ``limit`` whole records for the figures that draw per record: every rank named
    in ``keep_ranks`` (outliers) plus the lowest rank, at evenly spaced iterations (first and last
    included), as plain dicts like manifest records."""
    ranks = sorted({*(keep_ranks or []), *(r for (r,) in con.execute(
        f"SELECT min(rank) FROM {_source(state)}").fetchall() if r is not None)})
    its = [i for (i,) in con.execute(
        f"SELECT DISTINCT iteration FROM {_source(state)} ORDER BY iteration").fetchall()]
    if not ranks or not its:
        return []
    per_it = con.execute(
        f"SELECT count(*) / count(DISTINCT iteration) FROM {_source(state)} "
        f"WHERE rank IN ({', '.join(map(str, ranks))})").fetchone()[0] or 1
    k = max(1, min(len(its), int(limit // max(per_it, 1))))
    picked = sorted({its[round(j * (len(its) - 1) / max(k - 1, 1))] for j in range(k)})
    cur = con.execute(
        f"SELECT * FROM {_source(state)} WHERE rank IN ({', '.join(map(str, ranks))}) "
        f"AND iteration IN ({', '.join(map(str, picked))}) ORDER BY rank, iteration, counter "
        f"LIMIT {int(limit)}")
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


@dataclass
class RankView:
    """What the report shows from the index: the header, the outlier ranks per metric (at most
    ``limit`` rows each), outlier cells per iteration, and the worst rank's band."""

    header: Header
    outliers: list[dict[str, Any]] = field(default_factory=list)
    per_iteration: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    worst_band: list[tuple[int, float, float, float, float | None]] = field(default_factory=list)
    worst: dict[str, Any] | None = None


def rank_view(con: Any, state: IndexState, limit: int = 20) -> RankView:
    view = RankView(header(con, state))
    if view.header.ranks < 3:
        return view
    view.outliers = outlier_ranks(con, state, None, limit)
    for metric in dict.fromkeys(r["metric"] for r in view.outliers):
        view.per_iteration[metric] = outliers_per_iteration(con, state, metric)
    if view.outliers:
        w = max(view.outliers, key=lambda r: r["worst_z"])
        view.worst = w
        view.worst_band = band(con, state, w["metric"], w, w["rank"])
    view.outliers.sort(key=lambda r: (r["first_iteration"], -r["worst_z"]))
    view.outliers = view.outliers[:limit]
    return view
