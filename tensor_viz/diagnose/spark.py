"""``lowp-diagnose --engine spark``: the diagnosis' queries in Spark SQL, for a capture or a flight
recorder's summaries too large for one machine (a 1,000-rank run on a cluster filesystem).

Every kind of ``tensor_viz.diagnose.KINDS`` has a Spark query (each Kind's ``spark``: the same
SQL text as DuckDB's, the few expressions the dialects spell differently in
tensor_viz.diagnose.sql_dialect), run through :class:`SparkConnection`, which answers the calls the queries
make of a DuckDB connection (``execute`` -> ``fetchone`` / ``fetchall`` / ``description``),
parameters bound by Spark (``spark.sql(query, args=...)``). :func:`opened` reads the folder into
Spark's narrow table: the columnar index's Parquet dataset (built by DuckDB, as for the report)
and the recorder's summary files, the summaries where no record covers the iteration, as
tensor_viz.diagnose.recorder_view does on DuckDB. pyspark is imported only here, only when asked for.
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lowp_common import UserError
from tensor_capture.recorder import read as recorder_read
from tensor_viz.diagnose import recorder_view, rules

SOURCE_VIEW = "diag_source"
#: the records' narrow table while a recorder's summaries are added beside it
_RECORDS = "diag_from_records"
#: the summary rows in the narrow columns, cached (without the formats' bounds)
_SUMMARY_ROWS = "diag_summary_rows"
#: master URL when none is given: Spark inside this process, two cores
DEFAULT_MASTER = "local[2]"
INSTALL = 'pip install -e ".[spark]" plus a Java runtime (e.g. apt-get install default-jre-headless)'
#: the session a local run starts (a cluster's own settings win where it sets them): no UI; a
#: driver large enough to keep the narrow table cached (at 1 GiB Spark evicts and rereads the
#: Parquet for every kind)
SESSION_CONFIG = {
    "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "8", "spark.driver.memory": "4g",
    "spark.sql.sources.parallelPartitionDiscovery.threshold": "1000000",
}
_CREATE = re.compile(r"^\s*CREATE OR REPLACE TEMP TABLE (\w+) AS\s+(.*)$", re.DOTALL | re.IGNORECASE)
#: DuckDB's isfinite, which Spark SQL lacks, as a session function (NULL stays NULL)
_ISFINITE = ("CREATE OR REPLACE TEMPORARY FUNCTION isfinite(x DOUBLE) RETURNS BOOLEAN "
             "RETURN NOT isnan(x) AND abs(x) != double('Infinity')")


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
    """What the diagnosis' queries ask of a connection, answered by a SparkSession: DuckDB's
    double-quoted identifiers and its ``isfinite`` are made Spark's for this session."""

    dialect = "spark"

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        spark.conf.set("spark.sql.ansi.doubleQuotedIdentifiers", "true")
        spark.sql(_ISFINITE)

    def execute(self, sql: str, params: list | None = None) -> _Result:
        """``sql`` with its ``?`` parameters bound by Spark, as DuckDB binds them; a ``CREATE
        OR REPLACE TEMP TABLE`` becomes a cached temporary view."""
        args = list(params) if params else None
        m = _CREATE.match(sql)
        if m:
            frame = self.spark.sql(m.group(2), args=args)
            frame.cache().createOrReplaceTempView(m.group(1))
            return _Result([], [])
        frame = self.spark.sql(sql, args=args)
        rows = frame.collect()
        return _Result([[_plain(v) for v in r] for r in rows], frame.columns)


def _java() -> str | None:
    """The Java runtime pyspark would start: $JAVA_HOME/bin/java, else java on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home:
        java = Path(home) / "bin" / "java"
        return str(java) if java.is_file() else None
    return shutil.which("java")


def session(master: str | None) -> tuple[Any, bool]:
    """(a SparkSession on ``master``, whether this call started it): the session already
    active in this process when there is one. Without pyspark or a Java runtime: one line
    naming the install (a usage error)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise UserError(f"--engine spark: pyspark is not installed; {INSTALL}") from None
    if _java() is None:
        where = (f"JAVA_HOME={os.environ['JAVA_HOME']} has no bin/java"
                 if os.environ.get("JAVA_HOME") else "no java on PATH")
        raise UserError(f"--engine spark: no Java runtime ({where}); {INSTALL}")
    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    builder = SparkSession.builder.master(master or DEFAULT_MASTER).appName("lowp-diagnose")
    for key, value in SESSION_CONFIG.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark, True


def _summaries(con: SparkConnection, folder: Any) -> str | None:
    """The narrow-table SELECT of the folder's summary files read by Spark (None: none): their
    rows cached once in the narrow columns, each format's largest value (``max_normal``) put in
    by the SELECT, from the formats the cached rows name (a scan of the cache, not of the
    files)."""
    files = recorder_read.summary_files(folder)
    if not files:
        return None
    view = recorder_view.SUMMARY_VIEW
    con.spark.read.option("mergeSchema", "true").parquet(*map(str, files)) \
        .createOrReplaceTempView(view)
    con.execute(f"CREATE OR REPLACE TEMP TABLE {_SUMMARY_ROWS} AS "
                f"{recorder_view._narrow_select(view, {})}")
    columns = con.spark.table(_SUMMARY_ROWS).columns
    bounds = recorder_view._bounds_sql(recorder_view._bounds(con, _SUMMARY_ROWS))
    select = ", ".join(f"{bounds} AS max_normal" if c == "max_normal" else c for c in columns)
    return f"SELECT {select} FROM {_SUMMARY_ROWS}"


def _count(con: SparkConnection, table: str) -> int:
    return int(con.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def _narrow(con: SparkConnection, state: Any, folder: Any) -> rules.Inputs:
    """The narrow table in Spark: the records' and the summaries where no record covers the
    (rank, iteration), the same rows recorder_view.add_summaries gives DuckDB."""
    summaries = _summaries(con, folder)
    if state is None:      # a view: its rows are cached already
        con.spark.sql(summaries).createOrReplaceTempView(rules.NARROW)
        return rules.Inputs(rules.NARROW, None, 0, _count(con, rules.NARROW))
    data = str(state.data_dir)
    con.spark.read.option("basePath", data).option("mergeSchema", "true").parquet(data) \
        .createOrReplaceTempView(SOURCE_VIEW)
    rules.materialize(con, None, relation=SOURCE_VIEW)
    if summaries is None:
        return rules.Inputs(rules.NARROW, SOURCE_VIEW, state.records)
    con.execute(f"CREATE OR REPLACE TEMP TABLE {_RECORDS} AS SELECT * FROM {rules.NARROW}")
    cols = ", ".join(con.spark.table(_RECORDS).columns)
    con.execute(f"""CREATE OR REPLACE TEMP TABLE {rules.NARROW} AS
        SELECT {cols} FROM {_RECORDS}
        UNION ALL
        SELECT {cols} FROM ({summaries}) AS s LEFT ANTI JOIN
            (SELECT DISTINCT rank, iteration FROM {_RECORDS}) AS r
            ON s.rank = r.rank AND s.iteration = r.iteration""")
    rows = _count(con, rules.NARROW) - _count(con, _RECORDS)
    return rules.Inputs(rules.NARROW, SOURCE_VIEW, state.records, rows)


@contextmanager
def opened(capture_dir: Any, master: str | None, index: Callable[[], Any]
           ) -> Iterator[tuple[SparkConnection, rules.Inputs]]:
    """(a Spark connection, the kinds' inputs) for a capture or recorder folder; ``index``
    opens the folder's columnar index (tensor_viz.diagnose.open_index's state), called once the
    session started, so a missing pyspark or Java is refused before any work. The session stops
    on leaving when this call started it."""
    spark, started = session(master)
    try:
        state = index()
        con = SparkConnection(spark)
        yield con, _narrow(con, state, capture_dir)
    finally:
        if started:
            spark.stop()
