"""The capture's manifests as a Parquet dataset, refreshed incrementally, queried with DuckDB.

Why: a cluster run leaves millions of manifest records (one JSON line per tensor per rank);
turning each into a Python object costs ~13 KB of RAM apiece, so a 1M-record capture needs
gigabytes before anything is drawn. Here DuckDB parses the JSON lines in C++ straight into typed
columns (nested statistics become structs and maps, never JSON strings) and writes them to
Parquet, partitioned by rank (a directory ``rank=<r>``) with row groups sorted by iteration, so
one rank or one iteration reads alone; reports aggregate over it in the engine
(:mod:`tensor_viz.rank_tables`) and Python holds only the aggregates.

Incremental: ``state.json`` keeps, per manifest, how many bytes were read (up to the last
complete line); a refresh reads only what was appended since, so a report of a running job is
cheap. A trailing line without its newline (a rank writing, or killed, mid-line) waits for the
next refresh; a line that is not a JSON record (a torn line followed by more records, a foreign
line) is counted as bad and skipped, and the first few are named as ``file:line``. A cache of
another index version, or manifests that shrank or were replaced, is rebuilt, never misread.

Where the cache goes: ``<capture>/.tensor_index`` when the capture folder is writable, else the
folder the user names, else a folder under the system's temporary directory (said in one line).
The dataset is the interchange format: pyarrow, Polars, DuckDB and Spark read it as is
(docs/visualization.md, "The columnar index").
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from lowp_common import UserError, atomic_write_json
from tensor_capture import schema

#: bump when the columns below change: an older cache is then rebuilt
INDEX_VERSION = 2
CACHE_DIRNAME = ".tensor_index"
DATA_DIRNAME = "data"
STATE_FILE = "state.json"
#: bad lines named per manifest (the rest are counted)
BAD_EXAMPLES = 3
#: one COPY reads at most this many manifests / bytes (memory follows the partitions written at
#: once); rows per Parquet row group (the unit a reader skips by its iteration min/max)
BATCH_FILES, BATCH_BYTES, ROW_GROUP_ROWS = 32, 512 << 20, 4096

#: the quantization analysis' numbers the index holds (what the diagnosis and rank tables
#: aggregate) ...
ANALYSIS_INDEXED = ("total", "overflow_ratio", "underflow_ratio", "flush_to_zero_ratio", "axis",
                    "block_size", "nan_blocks")
#: ... and the ones left in the JSON manifest: counts the ratios already carry, severities the
#: ratios decide, the format's limits and the one tensor's before/after magnitudes, which only the
#: report's view of that tensor reads
ANALYSIS_JSON_ONLY = ("format", "overflow_count", "underflow_count", "flush_to_zero_count",
                      "nan_count", "inf_count", "nonzero", "overflow_severity",
                      "underflow_severity", "flush_to_zero_severity", "max_normal", "min_normal",
                      "min_subnormal", "absmax_before", "absmax_after", "min_nonzero_before",
                      "min_nonzero_after", "range_before", "range_after")
_HIST = "STRUCT(min_bin BIGINT, counts BIGINT[])"
_WHATIF_FORMAT = ("STRUCT(sqnr_db DOUBLE, rel_error DOUBLE, overflow_ratio DOUBLE, "
                  "underflow_ratio DOUBLE, flush_ratio DOUBLE, axis BIGINT, block_size BIGINT, "
                  "axis_length BIGINT, blocks BIGINT, short_axis BOOLEAN, "
                  f"block_scale STRUCT(kind VARCHAR, min DOUBLE, max DOUBLE, std DOUBLE, hist {_HIST}), "
                  "block_clipped_hist BIGINT[], block_flushed_hist BIGINT[], "
                  f"block_dynamic_range_hist {_HIST}, error VARCHAR)")


def _struct(keys: tuple[str, ...], ints: tuple[str, ...] = ()) -> str:
    return "STRUCT(" + ", ".join(f"{k} {'BIGINT' if k in ints else 'DOUBLE'}" for k in keys) + ")"


def _name_type(annotation: Any) -> str:
    """The DuckDB type of a schema.TensorName field from its annotation (int or str)."""
    return "BIGINT" if "int" in str(annotation) else "VARCHAR"


#: metadata keys kept in the JSON manifest only, each for a reason: the per-operand recipe specs
#: ({gemm: spec summary}) are a few repeated strings per operand that no report aggregates; the
#: debug API's own names of a tensor repeat what the naming fields say in our vocabulary
JSON_ONLY = (schema.META_RECIPE_SPECS, schema.META_DEBUG_API)

#: the typed shape of one manifest record (DuckDB types): every key of schema.RECORD_KEYS but
#: JSON_ONLY (the naming fields from schema.TensorName, the statistics from schema.STAT_KEYS),
#: statistics and what-if numerics nested; tests/test_capture_schema_index.py fails on a record
#: key missing here.
RECORD_STRUCTURE: dict[str, Any] = {
    **{f.name: _name_type(f.type) for f in fields(schema.TensorName)},
    schema.META_SHAPE: "BIGINT[]", schema.META_DTYPE: "VARCHAR",
    schema.META_MODULE_PATH: "VARCHAR", schema.META_SUBMODULE: "VARCHAR",
    schema.META_VARIANT: "VARCHAR", schema.META_SAMPLED_ROWS: "BIGINT",
    schema.META_SAMPLED_ROW_STRIDE: "BIGINT",
    schema.META_EMULATED_FORMAT: "VARCHAR", schema.META_RECIPE: "VARCHAR",
    schema.META_PROBS_SAMPLE: {"heads": "BIGINT[]", "head_count": "BIGINT",
                               "row_stride": "BIGINT", "shape": "BIGINT[]"},
    **{k: "BIGINT" for k in schema.META_PARALLEL},
    schema.META_MCORE_VERSION: "VARCHAR", schema.MANIFEST_FILE: "VARCHAR",
    schema.META_STATS: {
        **{k: ("BIGINT" if k in schema.STAT_COUNT_KEYS else "DOUBLE") for k in schema.STAT_KEYS},
        schema.STAT_RANGE: f"MAP(VARCHAR, {_struct(schema.STAT_RANGE_KEYS)})",
        schema.STAT_LOG2_HIST: "STRUCT(min_exp BIGINT, counts BIGINT[])",
    },
    schema.META_QUANT_ANALYSIS: f"MAP(VARCHAR, {_struct(ANALYSIS_INDEXED)})",
    schema.META_WHATIF: {
        schema.WHATIF_AXIS: "BIGINT", schema.WHATIF_AXIS_SOURCE: "VARCHAR",
        schema.WHATIF_ELEMENTS: "BIGINT", schema.WHATIF_SAMPLED: "BOOLEAN",
        schema.WHATIF_FORMATS: f"MAP(VARCHAR, {_WHATIF_FORMAT})",
    },
}
#: naming fields every record must have to be counted (others are bad lines)
REQUIRED = tuple(f for f in schema.NAME_FIELDS
                 if f in ("layer_type", "operation", "tensor_name", "iteration"))


@dataclass
class IndexState:
    """What the index holds and how it got there (the report header reads it)."""

    cache_dir: Path
    records: int = 0                       # records in the dataset
    bad_lines: int = 0                     # lines skipped: not JSON, or not a record
    bad_examples: list[str] = field(default_factory=list)   # "manifest_rank3.jsonl:1201: why"
    pending_bytes: int = 0                 # trailing partial lines left for the next refresh
    manifests: int = 0
    new_records: int = 0                   # added by this refresh
    rebuilt: str | None = None             # why the cache was rebuilt, if it was
    note: str | None = None                # where the cache went, when not beside the capture

    @property
    def data_dir(self) -> Path:
        return self.cache_dir / DATA_DIRNAME

    @property
    def parquet_glob(self) -> str:
        return str(self.data_dir / "**" / "*.parquet")


def connect(threads: int | None = None, memory_limit: str = "1GB") -> Any:
    """A DuckDB connection with bounded memory, spilling beyond it into a folder of its own
    under the system's temporary directory (DuckDB's default, ``.tmp`` in the working
    directory, may be read-only or the user's project)."""
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET memory_limit='{memory_limit}'")
    spill = Path(tempfile.gettempdir()) / f"lowp_duckdb_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    con.execute(f"SET temp_directory={sql_string(spill)}")
    con.execute(f"SET threads={int(threads or max(1, min(os.cpu_count() or 1, 4)))}")
    con.execute("SET preserve_insertion_order=false")
    return con


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe_{os.getpid()}"
        probe.write_bytes(b"0")
        probe.unlink()
        return True
    except OSError:
        return False


def cache_location(capture_dir: Path, cache_dir: str | os.PathLike[str] | None) -> tuple[Path, str | None]:
    """(the cache folder, a note when it is not beside the capture)."""
    if cache_dir is not None:
        folder = Path(cache_dir)
        if not _writable(folder):
            raise UserError(f"--index-dir {folder}: cannot write there; name a writable folder")
        return folder, None
    beside = capture_dir / CACHE_DIRNAME
    if os.access(capture_dir, os.W_OK) and _writable(beside):
        return beside, None
    digest = hashlib.sha1(str(capture_dir.resolve()).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"tensor_index_{digest}"
    if not _writable(folder):
        raise UserError(f"{capture_dir}: read-only and no temporary folder is writable; "
                        "pass --index-dir DIR")
    return folder, (f"columnar index: {capture_dir} is read-only; the index is in {folder} "
                    "(--index-dir names another folder)")


def _load_state(cache: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((cache / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("index_version") == INDEX_VERSION else None


def _complete_end(path: Path, start: int, size: int) -> tuple[int, int, int]:
    """(byte offset just past the last newline in [start, size), complete lines in that
    range, how many of them are empty)."""
    end, lines, blank = start, 0, 0
    prev = b"\n"                      # a range starts at a line start
    with open(path, "rb") as fh:
        fh.seek(start)
        pos = start
        while pos < size:
            chunk = fh.read(min(1 << 24, size - pos))
            if not chunk:
                break
            n = chunk.count(b"\n")
            if n:
                lines += n
                blank += chunk.count(b"\n\n") + (prev == b"\n" and chunk[:1] == b"\n")
                end = pos + chunk.rfind(b"\n") + 1
            prev = chunk[-1:]
            pos += len(chunk)
    return end, lines, blank


def _bad_examples(path: Path, start: int, end: int, first_line: int, limit: int) -> list[str]:
    """The first ``limit`` bad lines of ``path`` in [start, end) as ``name:line: why``."""
    out: list[str] = []
    with open(path, "rb") as fh:
        fh.seek(start)
        pos, line_no = start, first_line
        for raw in fh:
            if pos >= end or len(out) >= limit:
                break
            pos += len(raw)
            line_no += 1
            text = raw.strip()
            if not text:
                continue
            try:
                rec = json.loads(text)
            except ValueError as exc:
                out.append(f"{path.name}:{line_no}: not JSON ({str(exc).split(':')[0]})")
                continue
            if not isinstance(rec, dict) or any(rec.get(k) is None for k in REQUIRED):
                out.append(f"{path.name}:{line_no}: not a capture record")
    return out


def _staged(path: Path, start: int, end: int, tmp: Path) -> Path:
    """The bytes [start, end) of ``path`` as a file DuckDB can read (the file itself when the
    range is all of it)."""
    if start == 0 and end == path.stat().st_size:
        return path
    part = tmp / f"{start}" / path.name          # the same file name: records keep their manifest
    part.parent.mkdir(exist_ok=True)
    with open(path, "rb") as src, open(part, "wb") as dst:
        src.seek(start)
        left = end - start
        while left > 0:
            chunk = src.read(min(1 << 24, left))
            if not chunk:
                break
            dst.write(chunk)
            left -= len(chunk)
    return part


def _duck_type(t: Any) -> str:
    """A RECORD_STRUCTURE entry as a DuckDB type."""
    if isinstance(t, dict):
        return "STRUCT(" + ", ".join(f"{_q(k)} {_duck_type(v)}" for k, v in t.items()) + ")"
    return str(t)


def _select_sql(sources: list[str]) -> str:
    """Typed rows of the given JSON-lines files (DuckDB's reader, straight into the columns of
    RECORD_STRUCTURE; a line that is not JSON comes back empty), with their manifest and
    whether they are a record (every REQUIRED field present)."""
    files = "[" + ", ".join(sql_string(src) for src in sources) + "]"
    columns = "{" + ", ".join(f"{sql_string(k)}: {sql_string(_duck_type(v))}"
                              for k, v in RECORD_STRUCTURE.items()) + "}"
    required = " AND ".join(f"{_q(k)} IS NOT NULL" for k in REQUIRED)
    return f"""
        SELECT * EXCLUDE (filename), parse_filename(filename) AS manifest, {required} AS valid
        FROM read_json({files}, format='newline_delimited', columns={columns},
                       ignore_errors=true, filename=true, maximum_object_size=100000000)"""


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def refresh(capture_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
            say: Callable[[str], None] | None = None, con: Any = None) -> IndexState:
    """Bring the index of ``capture_dir`` up to date with its manifests (module docstring)."""
    root = Path(capture_dir)
    if not root.is_dir():
        raise UserError(f"{root}: no such capture folder")
    cache, note = cache_location(root, cache_dir)
    if note and say:
        say(note)
    state = IndexState(cache_dir=cache, note=note)
    old = _load_state(cache)
    files = {p.name: p for p in sorted(root.glob(schema.MANIFEST_GLOB))}
    seen: dict[str, Any] = dict((old or {}).get("manifests") or {})
    rebuilt = None
    if old is None and (cache / DATA_DIRNAME).exists():
        rebuilt = "an index of another version"
    for name, info in seen.items():
        p = files.get(name)
        if p is None or p.stat().st_size < info.get("offset", 0) or (
                info.get("inode") not in (None, p.stat().st_ino)):
            rebuilt = f"{name} shrank, vanished or was replaced"
            break
    if rebuilt or old is None:
        shutil.rmtree(cache / DATA_DIRNAME, ignore_errors=True)
        seen = {}
    state.rebuilt = rebuilt
    con = con or connect()
    tmp = Path(tempfile.mkdtemp(prefix="stage_", dir=cache))
    try:
        sources, spans = [], {}
        for name, path in files.items():
            info = seen.get(name) or {"offset": 0, "lines": 0, "records": 0, "bad": 0,
                                      "examples": []}
            size = path.stat().st_size
            end, lines, blank = _complete_end(path, info["offset"], size)
            if end > info["offset"]:
                sources.append(str(_staged(path, info["offset"], end, tmp)))
                spans[name] = (info["offset"], end, info["lines"], lines, blank)
            info["pending"] = size - end
            info["inode"] = path.stat().st_ino
            seen[name] = info
        if sources:
            _ingest(con, sources, spans, seen, files, cache)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, info in seen.items():
        state.records += info["records"]
        state.bad_lines += info["bad"]
        state.pending_bytes += info.get("pending", 0)
        state.bad_examples += info["examples"]
        state.new_records += info.pop("new", 0)
    state.bad_examples = state.bad_examples[: 2 * BAD_EXAMPLES]
    state.manifests = len(files)
    atomic_write_json(cache / STATE_FILE, {"index_version": INDEX_VERSION, "manifests": seen})
    return state


def _ingest(con, sources, spans, seen, files, cache: Path) -> None:
    """Parse the staged ranges straight into new Parquet parts (valid records only; rows of
    one manifest stay in file order, i.e. by iteration), then count per manifest what was
    kept; the other non-empty lines are bad."""
    data = cache / DATA_DIRNAME
    data.mkdir(parents=True, exist_ok=True)
    keep = ", ".join(_q(k) for k in RECORD_STRUCTURE) + ", manifest"
    part = f"part-{uuid.uuid4().hex[:12]}"
    # in batches of files: a partitioned write buffers a row group per open partition, so
    # memory follows the ranks written at once, not the capture
    for n, batch in enumerate(_batches(sources)):
        con.execute(f"""COPY (SELECT {keep} FROM ({_select_sql(batch)}) WHERE valid)
            TO {sql_string(data)} (FORMAT parquet, PARTITION_BY (rank),
            FILENAME_PATTERN '{part}-{n}-{{i}}', OVERWRITE_OR_IGNORE,
            ROW_GROUP_SIZE {ROW_GROUP_ROWS})""")
    written = list(data.glob(f"*/{part}-*.parquet"))
    counts: dict[str, int] = {}
    if written:
        listing = "[" + ", ".join(sql_string(w) for w in written) + "]"
        counts = dict(con.execute(f"SELECT manifest, count(*) FROM read_parquet({listing}) "
                                  "GROUP BY manifest").fetchall())
    for name, (start, end, first_line, lines, blank) in spans.items():
        got = counts.get(name, 0)
        info = seen[name]
        bad = max(lines - blank - got, 0)
        info["records"] += got
        info["new"] = got
        info["bad"] += bad
        if bad and len(info["examples"]) < BAD_EXAMPLES:
            info["examples"] += _bad_examples(files[name], start, end, first_line,
                                              BAD_EXAMPLES - len(info["examples"]))
        info["offset"], info["lines"] = end, first_line + lines


def _batches(sources: list[str]) -> list[list[str]]:
    """Sources grouped so that one COPY reads at most BATCH_FILES files / BATCH_BYTES bytes."""
    out: list[list[str]] = [[]]
    size = 0
    for src in sources:
        n = os.path.getsize(src)
        if out[-1] and (len(out[-1]) >= BATCH_FILES or size + n > BATCH_BYTES):
            out.append([])
            size = 0
        out[-1].append(src)
        size += n
    return out


def sql_string(value: Any) -> str:
    """``value`` as a single-quoted SQL string literal (quotes doubled)."""
    return "'" + str(value).replace("'", "''") + "'"


#: the high-precision variant (schema.VARIANT_HP) as an SQL literal; a record without a variant
#: is one (the first captures wrote none)
SQL_HP = sql_string(schema.VARIANT_HP)
