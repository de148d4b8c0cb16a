"""What the flight recorder writes: per-iteration summaries (Parquet), the losses it saw, the
ring as ordinary stats-only manifest records, and one JSON line per trigger.

Why the ring as manifest records: ``lowp-diagnose`` and the report read a capture folder's
``manifest_rank*.jsonl``; the W iterations before a trigger written there with the same keys
(iteration, sample_idx = micro-batch, rank, module path, a counter in execution order, the
statistics under ``stats``) are read like any stats-only capture, and the full capture of the
J iterations after it lands in the same manifests. Layout: docs/capture.md "Recorder mode".
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lowp_common import atomic_path

from .. import schema
from .read import moments
from .ring import _UFUNC, IterStats, SiteInfo, SlotBook
from .stats import FLUSH, INF, MAX, MIN, NAN, SAT, SUM, SUMSQ


class SummaryWriter:
    """Rows of iteration x site (micro-batches merged) gathered in memory, written as one
    Parquet file per ``every`` iterations per rank (rank-partitioned names, atomic); with them,
    the iterations' losses appended to the rank's loss file (the loss kinds of ``lowp-diagnose``
    read it, so a recorder folder needs no training log)."""

    def __init__(self, directory: Path, rank: int, every: int, keep: int) -> None:
        self.directory = directory
        self.rank = rank
        self.every = every
        self.keep = keep                # iterations kept at full resolution (rollup)
        self._chunks: list[tuple[int, np.ndarray, np.ndarray]] = []   # (iteration, sites, stats)
        self._sites: list[SiteInfo] = []        # the book's sites (a summary row names its site)
        self._site_cols: dict[str, list[Any]] = {k: [] for k in schema.REC_SITE_KEYS}
        self.first: int | None = None
        self.iterations = 0
        self.files: list[Path] = []
        self.losses: list[tuple[int, float]] = []

    def add(self, book: SlotBook, entry: IterStats) -> None:
        """One iteration's rows (the sites seen, micro-batches merged) as one array each: a
        step's summary costs a few numpy calls, not Python work per site."""
        merged = book.merged(entry)
        present = np.flatnonzero(merged["micro_batches"] > 0)
        if self.first is None:
            self.first = entry.iteration
        self.iterations += 1
        if not math.isnan(entry.loss):      # NaN: no loss on this rank (not the last stage)
            self.losses.append((entry.iteration, float(entry.loss)))
        self._sites = book.sites
        stats = np.stack([merged[k][present] for k in _NUMERIC])
        self._chunks.append((entry.iteration, present, stats))

    def _table(self) -> Any:
        """The rows gathered so far as one Arrow table: the columns, types and values the
        rows would have as Python lists (a naming column with no value in any row is of type
        null, as pyarrow infers for a list of None)."""
        import pyarrow as pa

        for info in self._sites[len(self._site_cols["site"]):]:     # sites new since last time
            for key, value in _site_columns(info).items():
                self._site_cols[key].append(value)
        sites = np.concatenate([c[1] for c in self._chunks])
        stats = np.concatenate([c[2] for c in self._chunks], axis=1)
        cols: dict[str, Any] = {
            "iteration": np.concatenate([np.full(len(c[1]), c[0], dtype=np.int64)
                                         for c in self._chunks]),
            "rank": pa.array([self.rank] * len(sites))}
        take = pa.array(sites)
        for key in schema.REC_SITE_KEYS:
            col = pa.array(self._site_cols[key]).take(take)
            cols[key] = pa.nulls(len(col)) if col.null_count == len(col) else col
        for i, key in enumerate(_NUMERIC):
            cols[key] = stats[i].astype(np.int64) if key in _INTEGER else stats[i]
        return pa.table({k: cols[k] for k in schema.REC_SUMMARY_COLUMNS})

    def due(self) -> bool:
        return self.iterations >= self.every

    def write(self) -> Path | None:
        """Write the rows gathered so far (nothing when there are none)."""
        if self.first is None:
            return None
        self._write_losses()
        latest = max((c[0] for c in self._chunks if len(c[1])), default=None)
        path = None
        if latest is not None:     # else no site seen (e.g. a stage without the layers): no file
            path = self.directory / schema.recorder_summary_name(self.rank, self.first)
            write_summary_table(self._table(), path)
            self.files.append(path)
            rollup(self.directory, self.rank, latest, self.keep)
        self._chunks = []
        self.first, self.iterations = None, 0
        return path

    def _write_losses(self) -> None:
        """The losses gathered so far, one JSON line each, appended in one write."""
        if self.losses:
            text = "".join(json.dumps({"iteration": it, "rank": self.rank, "loss": v}) + "\n"
                           for it, v in self.losses)
            _append(self.directory / schema.recorder_loss_name(self.rank), text.encode())
            self.losses = []


#: a summary row's statistics, in the order add() stacks them; the counts among them are integers
_NUMERIC = ("micro_batches", "count", *schema.REC_STATS)
_INTEGER = frozenset(k for k in _NUMERIC if k in ("micro_batches", "count") or k.endswith("_count"))
_FLOATS = [k for k in schema.REC_STATS if k not in _INTEGER]
_DICTIONARY = [c for c in schema.REC_SUMMARY_COLUMNS if c not in _FLOATS]


def write_summary_table(table: Any, path: Path) -> Path:
    """``table`` (summary rows) as the Parquet file ``path``, atomically: the one layout every
    summary file has. Rows of one site next to each other, floats byte-split and not
    dictionary-encoded (a site's values change slowly: ~14 B a row instead of ~23 B); one row
    group, so its statistics (iteration and nan_count min/max) let a reader skip the file."""
    table = table.sort_by([("site", "ascending"), ("iteration", "ascending")])
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        import pyarrow.parquet as pq

        pq.write_table(table, tmp, compression="zstd",
                       use_dictionary=[c for c in _DICTIONARY if c in table.column_names],
                       use_byte_stream_split=_FLOATS, row_group_size=max(table.num_rows, 1))
    return path


#: a tier's rows span ROLLUP_FACTOR times the iterations of the tier below; ROLLUP_FACTOR of a
#: tier's files that have aged out merge into one file of the next tier
ROLLUP_FACTOR = 10
#: how the columns of a span merge: schema.REC_MERGE, and the micro-batches seen add
_SPAN_MERGE = {"micro_batches": "sum", **schema.REC_MERGE}


@dataclass(frozen=True)
class SummaryFile:
    """A summary file and what its name and footer say: rank, tier, iterations [first, last]."""

    path: Path
    rank: str
    tier: int
    first: int
    last: int


def summary_file(path: Path) -> SummaryFile | None:
    """``path`` as a SummaryFile (None: not a summary file's name); a full-resolution file's
    last iteration is read from its footer's statistics (no row is read)."""
    m = schema.RECORDER_TIER_RE.search(path.name)
    if m is None:
        return None
    if m["tier"] is not None:
        return SummaryFile(path, m["rank"], int(m["tier"]), int(m["first"]), int(m["last"]))
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    col = meta.schema.names.index("iteration")
    last = max(meta.row_group(g).column(col).statistics.max for g in range(meta.num_row_groups))
    return SummaryFile(path, m["rank"], 0, int(m["first"]), int(last))


def rollup(directory: Path, rank: int | None, latest: int, keep: int) -> list[Path]:
    """Merge this rank's summary files that aged out of their tier into the next tier, exactly
    (_SPAN_MERGE), ROLLUP_FACTOR files at a time, oldest first; returns the files written.

    Tier t's rows span ROLLUP_FACTOR**t iterations (bucketed by iteration // that, cut where
    the files are); a tier-t file ages out when its last iteration is more than
    keep * ROLLUP_FACTOR**t before ``latest``. So a site keeps ~keep rows per tier and the
    tiers grow with log10 of the run. Crash-safe: the tier file is written (atomic rename)
    before the finer ones are removed; a reader skips finer files a tier file covers
    (recorder_read.summary_files), so a crash between the two neither loses nor doubles rows."""
    name = schema._fmt_int(rank)
    written: list[Path] = []
    tier = 0
    while True:
        files = [f for f in map(summary_file, directory.glob(f"summary_rank{name}_it*.parquet"))
                 if f is not None and f.rank == name]
        if not any(f.tier >= tier for f in files):
            return written
        mine = sorted((f for f in files if f.tier == tier), key=lambda f: f.first)
        old = [f for f in mine if f.last < latest - keep * ROLLUP_FACTOR ** tier]
        if len(old) >= ROLLUP_FACTOR:
            written.append(_merge_files(old[:ROLLUP_FACTOR], rank, tier + 1))
            continue                   # the same tier again: more may have aged out
        tier += 1


def _merge_files(files: list[SummaryFile], rank: int | None, tier: int) -> Path:
    """One tier-``tier`` file of ``files``' rows merged per site and span; then ``files`` go."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables([pq.read_table(f.path) for f in files], promote_options="permissive")
    merged = merge_spans(table, ROLLUP_FACTOR ** tier)
    path = files[0].path.parent / schema.recorder_tier_name(rank, files[0].first, files[-1].last,
                                                            tier)
    write_summary_table(merged, path)
    for f in files:
        f.path.unlink(missing_ok=True)
    return path


def merge_spans(table: Any, span: int) -> Any:
    """Summary rows merged per (site, iteration // span): counts and sums add, extremes take
    theirs (_SPAN_MERGE, in row order within a group); ``iteration`` the group's first,
    schema.REC_LAST_ITERATION its last; the naming columns the site's."""
    import pyarrow as pa

    last_col = schema.REC_LAST_ITERATION
    first = table["iteration"].to_numpy()
    last = (table[last_col].fill_null(table["iteration"]).to_numpy()
            if last_col in table.column_names else first)
    site = table["site"].to_numpy()
    order = np.lexsort((first, first // span, site))
    key = np.stack([site[order], first[order] // span])
    starts = np.flatnonzero(np.r_[True, np.any(key[:, 1:] != key[:, :-1], axis=0)])
    heads = order[starts]
    cols: dict[str, Any] = {c: table[c].take(pa.array(heads)) for c in schema.REC_SUMMARY_COLUMNS}
    for c, how in _SPAN_MERGE.items():
        values = table[c].to_numpy()[order]
        cols[c] = pa.array(_UFUNC[how].reduceat(values, starts))
    cols[last_col] = pa.array(np.maximum.reduceat(last[order], starts))
    return pa.table(cols)


def _site_columns(info: SiteInfo) -> dict[str, Any]:
    s = info.site
    return {"site": info.index, "module_path": s.module_path, "layer_type": s.layer_type,
            "layer_idx": s.layer_idx, "operation": s.operation, "phase": s.phase,
            "tensor_name": s.tensor_name, "variant": s.variant, "quant_type": info.quant_type}


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def record_stats(row: np.ndarray, count: float, fmt_name: str | None) -> dict[str, Any]:
    """A slot's row as the manifest's ``stats`` dict (schema.STAT_KEYS; what the recorder does
    not keep is None), with one ``range`` entry for the format it was judged against."""
    n = int(count)
    mean, std = moments(n, row[NAN], row[INF], row[SUM], row[SUMSQ])
    lo, hi = _finite(row[MIN]), _finite(row[MAX])
    out: dict[str, Any] = {
        "numel": n, "min": lo, "max": hi, "mean": _finite(mean), "std": _finite(std),
        "absmax": max(abs(lo), abs(hi)) if lo is not None and hi is not None else None,
        "min_nonzero_abs": None, "zero_count": None,
        "nan_count": int(row[NAN]), "inf_count": int(row[INF]),
    }
    if fmt_name is not None:
        sat, flush = int(row[SAT]), int(row[FLUSH])
        denom = max(n, 1)
        out[schema.STAT_RANGE] = {fmt_name: {
            "overflow_count": sat, "overflow_ratio": sat / denom,
            "flush_to_zero_count": flush, "flush_to_zero_ratio": flush / denom}}
    return out


def ring_records(book: SlotBook, ring: list[IterStats], rank_info: dict[str, Any],
                 timestamp: str, emulated: str | None = None) -> list[dict[str, Any]]:
    """The ring as manifest records: every slot seen in each iteration, in slot (execution)
    order; ``counter`` is the slot's order, so a reader's per-micro-batch order is the run's."""
    out = []
    for entry in ring:
        for slot in np.flatnonzero(entry.seen):
            info = book.sites[book.slot_site[slot]]
            s = info.site
            rec = {
                "layer_type": s.layer_type, "operation": s.operation,
                "tensor_name": s.tensor_name, "quant_type": info.quant_type,
                "layer_idx": s.layer_idx, "phase": s.phase, "component": s.component,
                "iteration": entry.iteration, "rank": rank_info["rank"],
                "sample_idx": book.slot_sample[slot], "timestamp": timestamp,
                "counter": int(slot) + 1, "schema_version": schema.SCHEMA_VERSION,
                schema.META_SHAPE: info.shape, schema.META_DTYPE: info.dtype,
                schema.META_MODULE_PATH: s.module_path, schema.META_SUBMODULE: s.submodule,
                schema.META_VARIANT: s.variant, schema.META_SAMPLED_ROWS: None,
                schema.META_SAMPLED_ROW_STRIDE: None, schema.META_EMULATED_FORMAT: emulated,
                **{k: rank_info.get(k) for k in schema.META_PARALLEL},
                schema.META_STATS: record_stats(entry.stats[slot], entry.count[slot],
                                                info.fmt.name if info.fmt else None),
                schema.MANIFEST_FILE: None,
            }
            out.append(rec)
    return out


def write_ring(directory: Path, rank: int, records: list[dict[str, Any]]) -> None:
    """Append the ring's records to this rank's manifest (one write per record line)."""
    for rec in records:
        schema.append_manifest(directory, rank, rec)


def append_trigger(directory: Path, rank: int, record: dict[str, Any]) -> Path:
    """One line in this rank's triggers file, as one write (O_APPEND keeps lines whole)."""
    path = directory / schema.recorder_triggers_name(rank)
    _append(path, (json.dumps(record, default=str) + "\n").encode())
    return path


def _append(path: Path, data: bytes) -> None:
    """``data`` at the end of ``path`` in one write (O_APPEND keeps its lines whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
