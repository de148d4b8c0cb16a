"""lowp-diagnose on a many-rank flight recorder folder: rows/s and peak memory per engine, and
whether three planted faults are named.

The folder is made from a REAL summary file (a recorder run of the tiny model: ``--source`` a
recorder folder or summary file, else a short llama-train run in recorder mode makes one): its
iterations replicated to ``--iterations``, its rank copied to ``--ranks`` ranks, each rank's
values scaled by its own factor near 1 (jitter), written in the recorder's own layout
(tensor_capture.recorder.out.write_summary_table, one file per rank per 50 iterations). Planted:
a NaN (one rank, one iteration, one site), a drift (one site's values growing 5x over the run,
every rank) and an outlier rank (one rank's values x50 on every site). ``lowp-diagnose DIR
--json -`` then runs in a child process per engine; its peak RSS comes from wait4.

    python bench/bench_recorder_scale.py [--ranks 128] [--iterations 2000] [--engines duckdb spark]
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowp_common import (  # noqa: E402
    CommandParser,
    HelpWithDefaults,
    UserError,
    atomic_write_text,
    cli_entry,
)

#: the children import this checkout too
CHILD_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
#: what is planted where (ranks / iterations as fractions of the run, so any size has them)
NAN_SITE, DRIFT_SITE, OUTLIER_FACTOR, DRIFT_GROWTH = 40, 20, 50.0, 5.0
SCALED = {"sum": 1, "min": 1, "max": 1, "sumsq": 2}   # column -> power of the value scale


def _parser() -> CommandParser:
    ap = CommandParser(description=__doc__.split("\n\n")[0], formatter_class=HelpWithDefaults)
    ap.add_argument("--source", default=None, metavar="DIR|FILE",
                    help="a recorder folder or summary Parquet file of a real run (default: a "
                         "short llama-train run of the tiny model in recorder mode makes one)")
    ap.add_argument("--ranks", type=int, default=128, help="ranks written")
    ap.add_argument("--iterations", type=int, default=2000, help="iterations per rank")
    ap.add_argument("--every", type=int, default=50, help="iterations per summary file")
    ap.add_argument("--engines", nargs="+", default=["duckdb", "spark"],
                    choices=["duckdb", "spark"], help="lowp-diagnose engines to run")
    ap.add_argument("--rollup", type=int, default=0, metavar="ITERATIONS",
                    help="instead: one rank of the source's sites written for ITERATIONS "
                         "iterations as the recorder writes them (rollup tiers on), and the "
                         "size per site said")
    ap.add_argument("--keep", type=int, default=1000,
                    help="--rollup: iterations kept at full resolution (recorder_full_iterations)")
    ap.add_argument("--work", default=None, metavar="DIR",
                    help="where the folder is written and kept (default: a temporary folder, "
                         "removed); one an earlier bench wrote there is diagnosed again")
    return ap


def source_table(source: str | None, work: Path) -> Any:
    """The real summary rows of one rank: from ``source``, else from a short real run."""
    from tensor_capture.recorder import read as recorder_read

    if source is None:
        source = str(_real_run(work / "source_run"))
    p = Path(source)
    if p.is_file():
        import pyarrow.parquet as pq

        table = pq.read_table(p)
    elif recorder_read.summary_files(p):
        table = recorder_read.read_summaries(p)
    else:
        raise UserError(f"--source {p}: no flight recorder summary there; give a recorder "
                        "folder or a summary_rank*_it*.parquet file")
    import pyarrow.compute as pc

    rank0 = table.filter(pc.equal(table["rank"], table["rank"][0]))
    bad = rank0.filter(pc.greater(pc.add(rank0["nan_count"], rank0["inf_count"]), 0))
    # the source's own non-finite iterations (a run that triggered) are left out: only the
    # planted NaN may be found
    clean = rank0.filter(pc.invert(pc.is_in(rank0["iteration"], bad["iteration"])))
    return clean.sort_by([("iteration", "ascending"), ("site", "ascending")])


def _real_run(out: Path) -> Path:
    """A 20-iteration llama-train run of the tiny model in recorder mode (one rank)."""
    from training_driver.data.corpus import write_builtin_corpus
    from training_driver.data.preprocess import preprocess

    corpus = out / "corpus.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    write_builtin_corpus(corpus, max_chars=60_000)
    data = preprocess([str(corpus)], str(out / "data" / "docs"), vocab_size=384, progress=False)
    env = dict(CHILD_ENV, TENSOR_SAVE_MODE="recorder", TENSOR_SAVE_DIR=str(out / "caps"),
               TENSOR_SAVE_CONFIG="")
    cmd = [sys.executable, "-m", "training_driver.train", "--data-path", data["data_prefix"],
           "--tokenizer", data["tokenizer"], "--model", "tiny", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--train-iters", "20", "--log-interval", "50"]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"the source run failed ({proc.stderr.strip().splitlines()[-1:]}); "
                        "give --source DIR of a recorder run")
    return out / "caps"


def plant(ranks: int, iterations: int) -> dict[str, Any]:
    """Where the three faults go."""
    return {"nan": {"rank": ranks // 3, "iteration": iterations * 3 // 4, "site": NAN_SITE},
            "drift": {"site": DRIFT_SITE}, "outlier": {"rank": ranks - 2}}


from tensor_capture.recorder.out import write_summary_table  # noqa: E402


def write_folder(src: Any, out: Path, ranks: int, iterations: int, every: int,
                 faults: dict[str, Any]) -> int:
    """The many-rank recorder folder (module docstring); returns its row count."""
    import pyarrow as pa

    from tensor_capture import schema

    its = np.unique(src["iteration"].to_numpy())
    sites = src.num_rows // len(its)
    site = src["site"].to_numpy()[:sites]
    base = {c: src[c].to_numpy() for c in SCALED}
    drift = 1.0 + (DRIFT_GROWTH - 1.0) * np.arange(iterations) / max(iterations - 1, 1)
    jitter = 1.0 + 0.02 * np.random.default_rng(0).standard_normal(ranks)
    nan = faults["nan"]
    rows = 0
    for first in range(0, iterations, every):
        it = np.arange(first, min(first + every, iterations))
        pick = ((it % len(its))[:, None] * sites + np.arange(sites)[None, :]).ravel()
        grow = np.where(site == faults["drift"]["site"], 1.0, 0.0)[None, :]
        scale0 = (1.0 + grow * (drift[it][:, None] - 1.0)).ravel()
        block = src.take(pick).set_column(0, "iteration", pa.array(np.repeat(it, sites)))
        for r in range(ranks):
            scale = scale0 * jitter[r] * (OUTLIER_FACTOR if r == faults["outlier"]["rank"]
                                          else 1.0)
            t = block.set_column(1, "rank", pa.array(np.full(len(pick), r)))
            for c, power in SCALED.items():
                t = t.set_column(t.column_names.index(c), c, pa.array(base[c][pick] * scale ** power))
            if r == nan["rank"] and first <= nan["iteration"] < first + every:
                hit = (np.repeat(it, sites) == nan["iteration"]) & (site[pick % sites] == nan["site"])
                nans = t["nan_count"].to_numpy() + hit
                t = t.set_column(t.column_names.index("nan_count"), "nan_count", pa.array(nans))
            write_summary_table(t, out / schema.recorder_summary_name(r, first))
            rows += len(pick)
    return rows


def run_engine(engine: str, folder: Path, work: Path) -> dict[str, Any]:
    """lowp-diagnose on ``folder`` in a child process: wall seconds, its own peak RSS (wait4),
    findings; an ``error`` line instead when the engine cannot run."""
    flag = ["--engine", engine] if _has_engine_flag() else []
    if not flag and engine != "duckdb":
        return {"engine": engine, "error": "lowp-diagnose has no --engine yet (DuckDB only)"}
    out, err = work / f"{engine}.json", work / f"{engine}.err"
    cmd = [sys.executable, "-m", "tensor_viz.diagnose.cli", str(folder), "--json", "-", *flag]
    t0 = time.perf_counter()
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True, env=CHILD_ENV)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    res = {"engine": engine, "seconds": time.perf_counter() - t0,
           "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_mib": usage.ru_maxrss / 1024}
    if proc.returncode != 0:
        lines = err.read_text().strip().splitlines()
        return {**res, "error": lines[-1] if lines else f"exit {proc.returncode}"}
    return {**res, "diagnosis": json.loads(out.read_text())}


def _has_engine_flag() -> bool:
    proc = subprocess.run([sys.executable, "-m", "tensor_viz.diagnose.cli", "--help"],
                          capture_output=True, text=True, env=CHILD_ENV)
    return "--engine" in proc.stdout


def named(diagnosis: dict[str, Any], faults: dict[str, Any], module_of: dict[int, str]
          ) -> dict[str, bool]:
    """Whether each planted fault is named: kind, rank, iteration, module as planted."""
    found = diagnosis["findings"]
    nan, drift, outlier = faults["nan"], faults["drift"], faults["outlier"]
    return {
        "nan": any(f["kind"] == "first_nonfinite" and f.get("rank") == nan["rank"]
                   and f.get("iteration") == nan["iteration"]
                   and f.get("module_path") == module_of[nan["site"]] for f in found),
        "drift": any(f["kind"] == "range_drift"
                     and f.get("module_path") == module_of[drift["site"]] for f in found),
        "outlier": any(f["kind"] == "rank_outlier" and f.get("rank") == outlier["rank"]
                       for f in found),
    }


def _make(args: Any, folder: Path) -> dict[str, Any]:
    """Write the folder (module docstring); what a later run needs to judge it."""
    src = source_table(args.source, folder.parents[1])
    faults = plant(args.ranks, args.iterations)
    module_of = dict(zip(src["site"].to_pylist(), src["module_path"].to_pylist()))
    t0 = time.perf_counter()
    rows = write_folder(src, folder, args.ranks, args.iterations, args.every, faults)
    files = list(folder.glob("*.parquet"))
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {rows:,} rows in {len(files):,} files ({size / 2**20:.1f} MiB, "
          f"{size / rows:.1f} B/row) in {time.perf_counter() - t0:.1f} s: {args.ranks} ranks x "
          f"{args.iterations} iterations x {len(module_of)} sites; planted {faults}")
    return {"rows": rows, "faults": faults, "module_of": module_of}


def rollup_size(src: Any, out: Path, iterations: int, every: int, keep: int) -> str:
    """One rank of ``src``'s sites, ``iterations`` long, written and rolled up as the recorder
    does (recorder_out.rollup after each file); the files, rows and bytes per site."""
    import pyarrow as pa

    from tensor_capture import schema
    from tensor_capture.recorder.out import rollup

    its = np.unique(src["iteration"].to_numpy())
    sites = src.num_rows // len(its)
    col = src.column_names.index("iteration")
    t0 = time.perf_counter()
    for first in range(0, iterations, every):
        it = np.arange(first, min(first + every, iterations))
        pick = ((it % len(its))[:, None] * sites + np.arange(sites)[None, :]).ravel()
        t = src.take(pick).set_column(col, "iteration", pa.array(np.repeat(it, sites)))
        write_summary_table(t, out / schema.recorder_summary_name(0, first))
        rollup(out, 0, int(it[-1]), keep)
    files = sorted(out.glob("*.parquet"))
    size = sum(f.stat().st_size for f in files)
    import pyarrow.parquet as pq

    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    return (f"rollup: {iterations:,} iterations x {sites} sites, R={keep}, K={every}: "
            f"{len(files)} files, {rows / sites:,.0f} rows and {size / sites / 1024:.1f} KiB per "
            f"site per rank ({iterations / (rows / sites):.0f}x fewer rows than iterations), "
            f"written in {time.perf_counter() - t0:.0f} s")


def _folder(args: Any, work: Path) -> tuple[Path, dict[str, Any]]:
    """The folder to diagnose: written now, or the one an earlier bench wrote in ``work``."""
    folder = work / "run" / "recorder"
    made = work / "made.json"
    if made.is_file():
        info = json.loads(made.read_text())
        print(f"reusing {folder} ({info['rows']:,} rows, planted {info['faults']})")
    elif folder.exists():
        raise UserError(f"--work {work}: holds a run/ but no made.json; name an empty folder")
    else:
        info = _make(args, folder)
        atomic_write_text(made, json.dumps(info))
    info["module_of"] = {int(k): v for k, v in info["module_of"].items()}
    return folder, info


@cli_entry("bench_recorder_scale")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.ranks < 3 or args.iterations < 8:
        raise UserError("--ranks must be at least 3 and --iterations at least 8 (the planted "
                        "outlier needs 3 ranks, the drift a few iterations)")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="recorder_scale_"))
    try:
        if args.rollup:
            src = source_table(args.source, work)
            print(rollup_size(src, work / "rollup", args.rollup, args.every, args.keep))
            return 0
        folder, info = _folder(args, work)
        for engine in args.engines:
            res = run_engine(engine, folder.parent, work)
            if "error" in res:
                print(f"{engine:>7}: failed: {res['error']}")
                continue
            hits = named(res["diagnosis"], info["faults"], info["module_of"])
            # CPU seconds beside the wall: on a shared machine the wall time says the load too.
            # Spark: the child is the Python driver; the JVM it starts is not reaped by it, so
            # its CPU and memory are not in these numbers (the wall time is the whole run's)
            print(f"{engine:>7}: {res['seconds']:.1f} s wall ({info['rows'] / res['seconds']:,.0f}"
                  f" rows/s), {res['cpu_seconds']:.1f} CPU s of the child, peak RSS "
                  f"{res['peak_rss_mib']:.0f} MiB; named: "
                  + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in hits.items()))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
