"""Build the figures and the report for a tensor directory: the library behind every CLI.

Summaries come from the manifest and stored statistics; values are read only from a
reproducible selection of files (plus files without stored statistics), one file at
a time in worker processes.
"""
from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tensor_capture import schema
from tensor_viz import plots_quant as pq
from tensor_viz.catalog import Catalog, Entry, ManifestIndex, Problem, UserError, scan
from tensor_viz.columnar import IndexState
from tensor_viz.data import Dataset, PairError
from tensor_viz.diagnose import recorder_view
from tensor_viz.figures import FigureSet

# Re-exported: callers import the section lists and defaults from here too.
from tensor_viz.options import (
    DEFAULT_WHATIF,
    ENHANCED_SECTIONS,
    FULL_SECTIONS,
    ORIGINAL_SECTIONS,
    SECTION_TABLE,
    Options,
)
from tensor_viz.result import Result

if TYPE_CHECKING:
    from tensor_viz.diagnose import Diagnosis

__all__ = ["DEFAULT_WHATIF", "ENHANCED_SECTIONS", "FULL_SECTIONS", "ORIGINAL_SECTIONS", "Options", "SECTIONS",
           "Result", "build", "diagnosis", "load", "draw"]
from tensor_viz import workers as worker_pool
from tensor_viz.file_reads import FileTask, PairTask, progress_bar, run_tasks


def _drawer(ref: str) -> Callable[[Dataset, FigureSet], None]:
    module, function = ref.split(":")
    return getattr(importlib.import_module(f"tensor_viz.{module}"), function)


# section name -> (drawing function, what the section answers), from options.SECTION_TABLE;
# order = order in index.html
SECTIONS: dict[str, tuple[Callable[[Dataset, FigureSet], None], str]] = {
    name: (_drawer(ref), text) for name, ref, text in SECTION_TABLE}


QUANTIZED_SUFFIXES = schema.QUANTIZED_SUFFIXES   # names and pairing: tensor_capture.schema
hp_twin_name = schema.hp_twin_name


def _pair_key(e: Entry, tensor_name: str):
    n = e.name
    return (n.iteration, n.layer_type, n.layer_idx, n.quant_type, n.rank, n.sample_idx, tensor_name,
            e.meta.get(schema.META_MODULE_PATH))


def _select(entries: list[Entry], opts: Options) -> list[Entry]:
    """Files to read values from: all without stats, plus a seeded round-robin over groups."""
    must = [e for e in entries if e.path and e.stats is None]
    pool = [e for e in entries if e.path and e.stats is not None]
    rng = random.Random(opts.seed)
    groups: dict[tuple, list[Entry]] = {}
    for e in sorted(pool, key=lambda e: e.path or ""):
        groups.setdefault((e.name.quant_type, e.name.layer_type, e.name.operation, e.name.tensor_name,
                           e.variant), []).append(e)
    queues = [rng.sample(g, len(g)) for _, g in sorted(groups.items(), key=lambda kv: str(kv[0]))]
    picked: list[Entry] = []
    while len(picked) < opts.max_value_files and any(queues):
        for q in queues:
            if q and len(picked) < opts.max_value_files:
                picked.append(q.pop())
    return must + picked


def _quant_available() -> bool:
    """True when quant's quantize() and metrics import (the numerics core is optional here)."""
    try:
        from quant import (
            metrics,  # noqa: F401
            quantize,
        )

        return callable(quantize)
    except Exception:
        return False


def _say(opts: Options):
    return (lambda line: print(f"visualize-tensors: {line}", flush=True)) if opts.progress else None


def _catalog(tensor_dir: str | Path, opts: Options, state: IndexState | None = None) -> Catalog:
    """The catalog, and nothing judged about it (the diagnosis is its own step: :func:`diagnosis`);
    with manifests, first their columnar index (tensor_viz.columnar): its header and outlier
    ranks always, and for a capture of more than ``opts.max_records`` records a catalog of a
    selection of them (the rank with the lowest number and the outlier ranks, at evenly spaced
    iterations) instead of every record. ``state``: the index already refreshed by this report
    (columnar.IndexState), else it is refreshed here."""
    from tensor_viz import catalog as cat_mod
    from tensor_viz import columnar, rank_tables

    root = cat_mod.check_directory(tensor_dir)
    if not any(root.glob(schema.MANIFEST_GLOB)):
        return scan(root)
    if state is None:
        state = columnar.refresh(root, opts.index_dir, say=_say(opts))
    con = columnar.connect()
    view = rank_tables.rank_view(con, state)
    if state.records <= opts.max_records:
        catalog = scan(root)
    else:
        keep = sorted({r["rank"] for r in view.outliers})
        records = rank_tables.selection(con, state, opts.selection_records, keep)
        catalog = cat_mod.from_records(root, records)
        ranks = sorted({r.get("rank") for r in records if r.get("rank") is not None})
        its = sorted({r.get("iteration") for r in records if r.get("iteration") is not None})
        catalog.selected = (f"figures drawn per record use {len(records):,} of {state.records:,} "
                            f"records: rank(s) {', '.join(map(str, ranks))} at {len(its)} "
                            f"iteration(s) ({', '.join(map(str, its[:12]))}{', ...' if len(its) > 12 else ''}); "
                            "the header, outlier ranks and numerics.csv cover every record")
    catalog.index = ManifestIndex(con, state, view)
    return catalog


def diagnosis(catalog: Catalog) -> Diagnosis | None:
    """The findings of tensor_viz.diagnose over the index the catalog opened (None when it
    holds no record); a flight recorder's folder that never triggered (summaries, no manifest):
    the findings of its summaries. Called once by the report, which passes the result along."""
    from tensor_viz.diagnose import diagnose

    idx = catalog.index
    if idx is None:
        root = Path(catalog.directory)
        return diagnose(root) if recorder_view.has_summaries(root) else None
    if not idx.state.records:
        return None
    return diagnose(Path(catalog.directory), con=idx.con, state=idx.state, rank_view=idx.view)


def load(tensor_dir: str | Path, opts: Options | None = None, values: bool = True,
         index_state: IndexState | None = None) -> tuple[Catalog, Dataset, int]:
    """Catalog the directory and read what the plots need. Returns (catalog, dataset, files read).
    ``index_state``: the manifests' columnar index when the caller refreshed it already."""
    opts = opts or Options()
    catalog = _catalog(tensor_dir, opts, index_state)
    ds = Dataset(entries=list(catalog.entries), rank_view=catalog.view,
                 capture_dir=str(tensor_dir))
    if not values:
        return catalog, ds, 0
    chosen = _select(ds.entries, opts)
    quant_ok = _quant_available()
    from tensor_viz import numerics_data

    ds.whatif_formats = numerics_data.report_formats(ds.entries, opts.whatif)
    if opts.whatif and not quant_ok:
        ds.notes["quantization_analysis"] = "the quant package (quantize, metrics) is not available"
    tasks = _file_tasks(chosen, ds.whatif_formats if quant_ok else (), opts,
                        numerics_data.site_axes(ds.entries))
    pairs = _pairs(ds.entries, opts) if quant_ok else []
    tasks += [PairTask(hp.path, q.path) for hp, q in pairs]
    dropped: set[int] = set()
    whatif_failures: dict[tuple[str, str], int] = {}
    results = iter(run_tasks(tasks, workers=opts.workers, progress=opts.progress,
                             timeout=opts.worker_timeout))   # folded as they arrive, in task order
    for e, res in zip(chosen, results):
        _apply_file_result(e, res, catalog, dropped, whatif_failures)
    for (hp, q), res in zip(pairs, results):
        if "error" in res:
            kind, reason = res["error"]
            catalog.problems.append(Problem(q.path or "", kind, reason))
        elif id(hp) not in dropped and id(q) not in dropped:
            ds.pairs.append(PairError(hp, q, res["errors"]))
    for (fmt, msg), n in sorted(whatif_failures.items()):
        catalog.problems.append(Problem(f"(what-if format {fmt})", "whatif", f"failed on {n} tensors: {msg}"))
    ds.entries = [e for e in ds.entries if id(e) not in dropped]
    catalog.entries = ds.entries
    ds.numerics = numerics_data.rows(ds.entries)
    return catalog, ds, len(chosen)


def _file_tasks(chosen: list[Entry], whatif: tuple[str, ...], opts: Options,
                axes: dict[tuple, int]) -> list[FileTask]:
    """One read per chosen file; the what-if formats capture did not store recomputed for at
    most ``opts.whatif_files`` high-precision tensors (on the axis capture used, ``axes``:
    numerics_data.site_axes), and heat maps
    for the first 24 labels, so that a large capture stays quick to draw."""
    from tensor_viz.numerics_data import capture_axis, missing_formats

    recomputed = 0
    heat_done: set = set()
    tasks = []
    for e in chosen:
        todo = missing_formats(e, whatif) if e.variant == schema.VARIANT_HP else ()
        if todo and recomputed >= opts.whatif_files:
            todo = ()
        recomputed += bool(todo)
        heat = e.label not in heat_done and len(heat_done) < 24
        heat_done.add(e.label)
        tasks.append(FileTask(path=e.path, sample_size=opts.sample_size, seed=opts.seed,
                              need_stats=e.stats is None, range_formats=(e.name.quant_type,), heat=heat,
                              whatif=todo, whatif_axis=capture_axis(e, axes) if todo else None))
    return tasks


def _apply_file_result(e: Entry, res: dict, catalog: Catalog, dropped: set[int],
                       whatif_failures: dict[tuple[str, str], int]) -> None:
    """Fold one file's read into its entry; an unreadable file becomes a problem, and is dropped
    when nothing about it was known before."""
    if "error" in res:
        kind, reason = res["error"]
        catalog.problems.append(Problem(e.path or "", kind, reason))
        if e.stats is None:
            dropped.add(id(e))
        return
    for k, v in res.get("meta", {}).items():
        e.meta.setdefault(k, v)
    if e.stats is None:
        e.stats = res.get("stats")
    e.sample, e.heat = res.get("sample"), res.get("heat")
    e.whatif = res.get("whatif")
    for f, m in ((e.whatif or {}).get(schema.WHATIF_FORMATS) or {}).items():
        if isinstance(m, dict) and "error" in m:
            whatif_failures[(f, m["error"])] = whatif_failures.get((f, m["error"]), 0) + 1


def _pairs(entries: list[Entry], opts: Options) -> list[tuple[Entry, Entry]]:
    """(high precision, quantized) operands of the same GEMM call, matched by name and site;
    the same pass is preferred (a wgrad operand's twin may come from the forward pass)."""
    if opts.max_pairs <= 0:
        return []
    hp: dict[tuple, dict[str, Entry]] = {}
    for e in entries:
        if e.path and e.variant != schema.VARIANT_QUANTIZED:
            hp.setdefault(_pair_key(e, e.name.tensor_name), {})[e.name.operation] = e
    pairs = []
    for q in sorted((e for e in entries if e.path and e.variant == schema.VARIANT_QUANTIZED), key=lambda e: e.path or ""):
        twins = hp.get(_pair_key(q, hp_twin_name(q.name.tensor_name)), {})
        twin = twins.get(q.name.operation) or next(iter(twins.values()), None)
        if twin is not None:
            pairs.append((twin, q))
    if len(pairs) > opts.max_pairs:
        pairs = random.Random(opts.seed).sample(pairs, opts.max_pairs)
    return pairs


_DRAW_STATE: dict = {}


def _set_draw_state(ds: Dataset, out_dir, opts: Options) -> None:
    import matplotlib

    matplotlib.use("Agg")
    _DRAW_STATE["args"] = (ds, out_dir, opts)


def _draw_section(name: str) -> list:
    """Draw one section into a fresh FigureSet (runs in a worker process or inline)."""
    ds, out_dir, opts = _DRAW_STATE["args"]
    fs = FigureSet(Path(out_dir), dpi=opts.dpi)
    fs.start_section(name)
    try:
        if name == "numerics_map":
            pq.draw_numerics_map(ds, fs, opts.map_stats)
        else:
            SECTIONS[name][0](ds, fs)
    except Exception as exc:  # a plotting bug must not lose the other sections
        fs.placeholder(name, f"drawing failed ({type(exc).__name__}: {str(exc)[:120]})")
    return fs.figures


def _not_drawn(name: str, reason: str, out_dir, opts: Options, bar) -> list:
    """One line naming the section, and a placeholder in the report saying what is missing."""
    line = (f"section {name} not drawn: {reason} (--worker-timeout sets the limit); "
            "the other sections are in the report")
    bar.write(f"visualize-tensors: {line}", file=sys.stderr)
    fs = FigureSet(Path(out_dir), dpi=opts.dpi)
    fs.placeholder(name, f"this section was not drawn: {reason}")
    return fs.figures


def draw(ds: Dataset, out_dir: str | Path, sections: tuple[str, ...], opts: Options) -> FigureSet:
    """Every section's figures; sections are drawn in ``opts.workers`` worker processes
    (tensor_viz.workers: at most ``opts.worker_timeout`` seconds each), inline when 1 or
    where no worker starts."""
    fs = FigureSet(Path(out_dir), dpi=opts.dpi)
    parallel = opts.workers > 1 and len(sections) > 1
    bar = progress_bar(total=len(sections), desc="drawing", unit="section",
                       disable=not opts.progress or not sections)   # no bar for no work
    done: dict[str, list] = {}
    try:
        if parallel:
            # Heaviest sections first so the workers finish together.
            order = sorted(sections, key=lambda s: s not in _HEAVY)
            try:
                for i, figs in worker_pool.run_bounded(_draw_section, order, opts.workers,
                                                       opts.worker_timeout, _set_draw_state,
                                                       (ds, out_dir, opts)):
                    if isinstance(figs, worker_pool.Failed):
                        figs = _not_drawn(order[i], figs.reason, out_dir, opts, bar)
                    done[order[i]] = figs
                    bar.update()
            except worker_pool.WorkersUnavailable as exc:
                bar.write(f"{exc}; drawing the remaining sections in this process", file=sys.stderr)
        _set_draw_state(ds, out_dir, opts)
        for s in sections:
            if s not in done:
                done[s] = _draw_section(s)
                bar.update()
    finally:
        bar.close()
        _DRAW_STATE.clear()
    for s in sections:
        fs.figures += done[s]
    return fs


_HEAVY = ("distributions", "heatmaps", "comparisons", "numerics_map", "overflow_analysis", "layer_analysis")


def _stamp(tensor_dir, out: Path, opts: Options, sections, quick: bool, report: bool
           ) -> tuple[str, Result | None, IndexState | None]:
    """(the stamp of this report, the reused Result when the report in ``out`` is current, the
    refreshed columnar index or None). Only captures with manifests are stamped (their index
    says whether anything is new)."""
    from tensor_viz import catalog as cat_mod
    from tensor_viz import columnar, report_stamp

    root = cat_mod.check_directory(tensor_dir)
    if not any(root.glob(schema.MANIFEST_GLOB)):
        return "", None, None
    state = columnar.refresh(root, opts.index_dir, say=_say(opts))
    stamp = report_stamp.fingerprint(state.cache_dir / columnar.STATE_FILE, opts, sections,
                                     quick, report)
    summary = (report_stamp.current(out, stamp)
               if state.new_records == 0 and not state.rebuilt else None)
    if summary is None:
        return stamp, None, state
    catalog = Catalog(directory=str(root), entries=[], problems=[])
    return stamp, Result(catalog, Dataset(entries=[]), FigureSet(out), reused=summary), state


def build(tensor_dir: str | Path, out_dir: str | Path, sections: tuple[str, ...] = FULL_SECTIONS,
          opts: Options | None = None, quick: bool = False, report: bool = True) -> Result:
    """Everything for one directory: sections' figures, optionally the quick view, and index.html."""
    from tensor_viz import quick as quick_view
    from tensor_viz import report as html

    opts = opts or Options()
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise UserError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--output_dir {out}: cannot create it ({exc.strerror})") from None
    if opts.workers > 1:
        worker_pool.warm_up()        # the workers' imports run while the capture is cataloged
    stamp, reused, state = _stamp(tensor_dir, out, opts, sections, quick, report)
    if reused is not None:                       # nothing new: the report there is current
        return reused
    catalog, ds, nread = load(tensor_dir, opts, index_state=state)
    found = diagnosis(catalog) if report else None    # the report's first section, once
    fs = draw(ds, out, sections, opts)
    result = Result(catalog, ds, fs, files_read=nread, diagnosis=found)
    from tensor_viz import numerics_csv

    index = catalog.index
    if index is not None and catalog.selected is not None:
        from tensor_viz import rank_tables

        # a large capture: every record's numerics, written by DuckDB from the index
        csv_name = numerics_csv.FILE_NAME if rank_tables.write_numerics_csv(
            index.con, index.state, out, numerics_csv.COLUMNS) else None
    else:
        csv_name = numerics_csv.write_csv(ds.entries, out, ds.numerics)
    if csv_name:
        result.extra_files.append(csv_name)
    if quick:
        result.extra_files += quick_view.write_quick(ds, catalog, out, fs)
    html.write_problems(catalog, out)
    if report:
        result.extra_files.append(html.write_index(result, out, sections, opts))
    if stamp:
        from tensor_viz import report_stamp

        report_stamp.write(out, stamp, {"tensors": len(catalog.entries), "drawn": result.drawn,
                                        "files_read": nread,
                                        "records": index.state.records if index else 0,
                                        "diagnosis": found.lines() if found else []})
    return result
