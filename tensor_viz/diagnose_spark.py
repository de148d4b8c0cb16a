"""The diagnosis' queries in Spark SQL over the columnar index's Parquet dataset, for a capture
too large for one machine (a 10,000-rank run on a cluster filesystem).

The kinds with a Spark query (``tensor_viz.diagnose.KINDS``, each kind's ``spark``: those over
the narrow table run the very SQL of :mod:`tensor_viz.diagnose_rules`) run through
:class:`SparkConnection`, which answers the few calls those functions make of a DuckDB
connection (``execute`` -> ``fetchone`` / ``fetchall`` / ``description``), query parameters
bound by Spark (``spark.sql(query, args=...)``); the expressions the two dialects spell
differently are ``diagnose_rules.DIALECTS``. pyspark is imported by the caller, never by this
package.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tensor_viz import diagnose_rules as rules
from tensor_viz.diagnose import KINDS, Diagnosis, rank

SOURCE_VIEW = "diag_source"
_CREATE = re.compile(r"^\s*CREATE OR REPLACE TEMP TABLE (\w+) AS (.*)$", re.DOTALL | re.IGNORECASE)


def spark_kinds() -> dict[str, Any]:
    """The kinds run here: those of ``tensor_viz.diagnose.KINDS`` registered with a Spark query."""
    return {name: kind.spark for name, kind in KINDS.items() if kind.spark is not None}


class _Result:
    def __init__(self, rows: list, columns: list[str]) -> None:
        self._rows, self.description = rows, [(c,) for c in columns]

    def fetchone(self):
        return tuple(self._rows[0]) if self._rows else None

    def fetchall(self):
        return [tuple(r) for r in self._rows]


def _plain(value: Any) -> Any:
    """Spark Rows (structs) as dicts, as DuckDB returns structs."""
    if hasattr(value, "asDict"):
        return {k: _plain(v) for k, v in value.asDict().items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class SparkConnection:
    """What diagnose_rules asks of a connection, answered by a SparkSession."""

    dialect = "spark"

    def __init__(self, spark: Any) -> None:
        self.spark = spark

    def execute(self, sql: str, params: list | None = None) -> _Result:
        """``sql`` with its ``?`` parameters bound by Spark, as DuckDB binds them."""
        args = list(params) if params else None
        m = _CREATE.match(sql)
        if m:
            frame = self.spark.sql(m.group(2), args=args)
            frame.cache().createOrReplaceTempView(m.group(1))
            return _Result([], [])
        frame = self.spark.sql(sql, args=args)
        rows = frame.collect()
        return _Result([[_plain(v) for v in r] for r in rows], frame.columns)


def diagnose_parquet(spark: Any, data_dir: str | Path) -> Diagnosis:
    """The findings of the :func:`spark_kinds` over a columnar index's dataset (``<index>/data``: the
    ``rank=<r>`` partitions), ranked as tensor_viz.diagnose ranks them."""
    spark.read.option("basePath", str(data_dir)).parquet(str(data_dir)).createOrReplaceTempView(
        SOURCE_VIEW)
    con = SparkConnection(spark)
    src = rules.materialize(con, None, relation=SOURCE_VIEW)
    records = con.execute(f"SELECT count(*) FROM {src}").fetchone()[0]
    result = Diagnosis(records=int(records), capture=str(data_dir))
    found = []
    for kind, query in spark_kinds().items():
        found += query(con, src)
        result.checked[kind] = KINDS[kind].checked
    result.findings = rank(found)
    return result
