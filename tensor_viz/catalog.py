"""Find the captured tensors of a directory: manifest records first, then file names.

Nothing here reads tensor values. Bad input (missing files, foreign names) becomes a
``Problem`` that the report counts; only a missing directory is an error.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowp_common import UserError
from tensor_capture import schema
from tensor_viz.columnar import CACHE_DIRNAME

if TYPE_CHECKING:                      # names for annotations only: cataloguing imports neither
    import duckdb
    import numpy as np

    from tensor_viz.columnar import IndexState
    from tensor_viz.rank_tables import RankView


@dataclass
class Problem:
    path: str
    kind: str      # short category: "corrupt", "foreign", "missing", "unsafe", ...
    reason: str


@dataclass
class Entry:
    """One captured tensor: naming fields, metadata, stored stats, and where its values are."""

    name: schema.TensorName
    meta: dict[str, Any]
    path: str | None
    stats: dict[str, Any] | None
    source: str                        # "manifest" or "file"
    sample: np.ndarray | None = None   # float32 sample of values, when read
    heat: np.ndarray | None = None     # small 2-D slice of values, when read
    #: the what-if record the report recomputed for formats capture did not store (the shape of
    #: ``meta["whatif"]``; tensor_viz.file_reads.recompute_whatif), None when none was
    whatif: dict[str, Any] | None = None

    @property
    def variant(self) -> str:
        return str(self.meta.get(schema.META_VARIANT) or schema.VARIANT_HP)

    @property
    def dtype(self) -> str:
        return str(self.meta.get(schema.META_DTYPE) or "unknown")

    @property
    def layer_label(self) -> str:
        n = self.name
        idx = "NA" if n.layer_idx is None else str(n.layer_idx)
        sub = self.meta.get(schema.META_SUBMODULE) or n.layer_type
        return f"L{idx} {sub}"

    @property
    def label(self) -> str:
        n = self.name
        return f"{self.layer_label} {n.operation} {n.tensor_name}"

    def range_stats(self) -> tuple[str, dict[str, float]] | None:
        """Overflow statistics against the tensor's own format: the stored range of its quant
        type, else the capture's quant analysis of it (scaled formats), else its dtype's range."""
        ranges = (self.stats or {}).get(schema.STAT_RANGE) or {}
        ranges = ranges if isinstance(ranges, dict) else {}
        qt = self.name.quant_type
        if isinstance(ranges.get(qt), dict):
            return qt, ranges[qt]
        analysis = (self.meta.get(schema.META_QUANT_ANALYSIS) or {})
        if isinstance(analysis, dict) and isinstance(analysis.get(qt), dict) and "overflow_ratio" in analysis[qt]:
            return qt, analysis[qt]
        for key in (self.dtype, self.dtype.replace("torch.", "")):
            if isinstance(ranges.get(key), dict):
                return key, ranges[key]
        return None


@dataclass
class ManifestIndex:
    """The manifests' columnar index as one run opened it (tensor_viz.columnar): kept open so
    that the figures, numerics.csv and the diagnosis read the same index, not each its own."""

    con: duckdb.DuckDBPyConnection
    state: IndexState
    view: RankView                     # what the report shows from it: header, outlier ranks


@dataclass
class Catalog:
    """Where a capture's tensors are and what was wrong with its input; no finding about them
    (the diagnosis is its own step: tensor_viz.pipeline.diagnosis)."""

    directory: str
    entries: list[Entry]
    problems: list[Problem]
    ignored: int = 0                   # files that are neither tensors nor manifests
    index: ManifestIndex | None = None  # the manifests' columnar index, when they exist
    #: a large capture: which records the figures draw from (numerics.csv then comes from the
    #: index, every record); None when every record was catalogued
    selected: str | None = None

    @property
    def view(self) -> RankView | None:
        return self.index.view if self.index is not None else None

    def problem_counts(self) -> dict[str, int]:
        return dict(Counter(p.kind for p in self.problems))


def _record_entry(directory: Path, record: dict[str, Any]) -> tuple[Entry | None, Problem | None]:
    try:
        name = schema.record_name(record)
    except (TypeError, ValueError) as exc:
        return None, Problem(str(directory), "bad-manifest", f"manifest record unusable: {exc}")
    rel = record.get(schema.MANIFEST_FILE)
    stats = record.get(schema.META_STATS) if isinstance(record.get(schema.META_STATS), dict) else None
    path = None
    problem = None
    if rel:
        candidate = directory / str(rel)
        if candidate.is_file():
            path = str(candidate)
        else:
            problem = Problem(str(candidate), "missing", "listed in the manifest but not on disk")
    if path is None and stats is None:
        return None, problem
    return Entry(name=name, meta=record, path=path, stats=stats, source="manifest"), problem


def from_records(directory: str | os.PathLike[str], records: list[dict[str, Any]]) -> Catalog:
    """A catalog of the given manifest records only (a large capture's selection from the
    columnar index; files not in the manifest are not looked for)."""
    root = Path(directory)
    entries: list[Entry] = []
    problems: list[Problem] = []
    for record in records:
        entry, problem = _record_entry(root, record)
        if problem:
            problems.append(problem)
        if entry:
            entries.append(entry)
    return Catalog(directory=str(root), entries=entries, problems=problems)


def check_directory(directory: str | os.PathLike[str]) -> Path:
    """``directory`` as a Path; UserError if it is not a directory."""
    root = Path(directory)
    if not root.exists():
        raise UserError(f"--tensor_dir {root}: no such directory (pass the folder the capture wrote, "
                        "e.g. $TENSOR_SAVE_DIR)")
    if not root.is_dir():
        raise UserError(f"--tensor_dir {root}: is a file, not a directory (pass the folder holding the .pt files)")
    return root


def scan(directory: str | os.PathLike[str]) -> Catalog:
    """Catalog ``directory``; UserError if it is not a directory."""
    root = check_directory(directory)
    entries: list[Entry] = []
    problems: list[Problem] = []
    known: set[str] = set()
    for record in schema.read_manifest(root):
        entry, problem = _record_entry(root, record)
        if problem:
            problems.append(problem)
        if entry:
            entries.append(entry)
            if entry.path:
                known.add(os.path.realpath(entry.path))
    ignored = 0
    skipped = {CACHE_DIRNAME, schema.RECORDER_DIR}   # the index; the flight recorder's own files
    for path in sorted(p for p in root.rglob("*")
                       if p.is_file() and not skipped & set(p.relative_to(root).parts)):
        if path.suffix != schema.TENSOR_SUFFIX:
            if not path.match(schema.MANIFEST_GLOB):
                ignored += 1
            continue
        if os.path.realpath(path) in known:
            continue
        try:
            name = schema.parse_filename(path.name)
        except ValueError:
            problems.append(Problem(str(path), "foreign", "not a captured tensor file name; skipped"))
            continue
        entries.append(Entry(name=name, meta=name.to_dict(), path=str(path), stats=None, source="file"))
    return Catalog(directory=str(root), entries=entries, problems=problems, ignored=ignored)
