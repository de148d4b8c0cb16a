"""The report of a cluster-scale capture: wall time and peak memory at a chosen record count.

A genuine stats-only capture of the tiny Llama (our training driver on megatron-core; what-if
numerics with --whatif) is replicated into ``manifest_rank*.jsonl`` files of many ranks and
iterations, in the capture's own layout, until the chosen number of records is reached; one
rank's absmax is multiplied by 50 from a third of the way in, so the outlier-rank table has
something to find. Then ``visualize-tensors`` runs three times in a child process: the first
report (the columnar index built from scratch), the same command again with nothing new (the
index checks its watermarks; the report in the folder is current), and a report into a new
folder (the index reused, every figure drawn).
Printed: records written, records the report counted (its header), wall time and the child's
peak RSS of each run, against the issue's goals.

    python bench/bench_report_scale.py --records 500000
    python bench/bench_report_scale.py --records 1000000 --keep /tmp/scale1m
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lowp_common import CommandParser, HelpWithDefaults

ROOT = Path(__file__).resolve().parents[1]
#: records -> (first report s, again s, peak RSS GiB): the issue's goals on a 2-core CPU
GOALS = {500_000: (30, 5, 1.0), 1_000_000: (60, 5, 2.0), 10_000_000: (600, 15, 4.0)}
OUTLIER_RANK, OUTLIER_FACTOR = 3, 50.0


def genuine_capture(work: Path, whatif: bool) -> list[dict]:
    """Manifest records of a real 2-iteration stats-only capture of the tiny Llama (with the
    default what-if numerics when ``whatif``: about twice the bytes per record)."""
    from training_driver.data.corpus import write_builtin_corpus
    from training_driver.data.preprocess import preprocess

    (work / "data").mkdir(parents=True, exist_ok=True)
    corpus = work / "data" / "corpus.jsonl"
    write_builtin_corpus(corpus, max_chars=60_000)
    summary = preprocess([str(corpus)], str(work / "data" / "docs"), vocab_size=384, progress=False)
    data = {"data_path": summary["data_prefix"], "tokenizer": summary["tokenizer"]}
    cap = work / "capture"
    cfg = work / "capture.yaml"
    cfg.write_text("stats_only: true\nmax_iterations: unlimited\n" + (
        "whatif_formats: default\nwhatif_budget: unlimited\n" if whatif else ""))
    env = dict(os.environ, TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(cap),
               TENSOR_SAVE_CONFIG=str(cfg), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "training_driver.train", "--data-path", data["data_path"],
           "--tokenizer", data["tokenizer"], "--model", "tiny", "--seq-length", "32",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
           "--checkpoint-dir", str(work / "ckpt")]
    subprocess.run(cmd, check=True, env=env, cwd=work, capture_output=True)
    return [json.loads(line) for p in sorted(cap.glob("manifest_rank*.jsonl"))
            for line in p.read_text().splitlines() if line.strip()]


def replicate(records: list[dict], total: int, out: Path, iterations: int) -> int:
    """``total`` records over ranks x ``iterations`` (ranks as many as needed)."""
    out.mkdir(parents=True, exist_ok=True)
    base = [r for r in records if r.get("iteration") == records[0].get("iteration")]
    per_rank = len(base) * iterations
    ranks = -(-total // per_rank)
    written = 0
    from tqdm import tqdm

    for rank in tqdm(range(ranks), desc="writing manifests", unit="rank"):
        lines = []
        for it in range(iterations):
            for r in base:
                if written >= total:
                    break
                rec = dict(r, rank=rank, iteration=it, file=None)
                if rank == OUTLIER_RANK and it >= iterations // 3 and rec.get("stats"):
                    rec["stats"] = dict(rec["stats"], absmax=(rec["stats"].get("absmax") or 0)
                                        * OUTLIER_FACTOR)
                lines.append(json.dumps(rec))
                written += 1
        (out / f"manifest_rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return written


def report(capture: Path, out: Path) -> tuple[float, float, str]:
    """(wall seconds, child peak RSS in GiB, the header line) of one visualize-tensors run."""
    script = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
              "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
              "w = time.perf_counter() - t; "
              "print(p.stdout[-4000:]); print(p.stderr[-4000:], file=sys.stderr); "
              "print('BENCH', w, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
              "sys.exit(p.returncode)")
    cmd = [sys.executable, "-c", script, sys.executable, "-m", "tensor_viz.full",
           "--tensor_dir", str(capture), "--output_dir", str(out), "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if res.returncode != 0:
        raise SystemExit(f"bench_report_scale: the report failed:\n{res.stderr[-3000:]}")
    m = re.search(r"BENCH ([0-9.]+) ([0-9]+)", res.stdout)
    html = (out / "index.html").read_text()
    header = re.search(r"Capture: ([^<]*)", html)
    return float(m.group(1)), int(m.group(2)) / 2**20, header.group(1) if header else "(no header)"


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(description=__doc__.split("\n\n")[0],
                       formatter_class=HelpWithDefaults)
    ap.add_argument("--records", type=int, default=500_000, help="manifest records to write")
    ap.add_argument("--iterations", type=int, default=25, help="iterations per rank")
    ap.add_argument("--whatif", action="store_true",
                    help="records with the default what-if numerics (the issue's figures are "
                         "without: what-if was off by default)")
    ap.add_argument("--keep", default=None, help="folder to keep the capture and reports in "
                    "(default: a temporary folder, removed afterwards)")
    args = ap.parse_args(argv)
    if args.records < 1 or args.iterations < 1:
        ap.error("--records and --iterations must be at least 1")
    work = Path(args.keep or tempfile.mkdtemp(prefix="bench_report_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    records = genuine_capture(work / "genuine", args.whatif)
    print(f"genuine capture: {len(records)} records in {time.perf_counter() - t:.0f} s")
    capture = work / "scaled"
    shutil.rmtree(capture, ignore_errors=True)
    written = replicate(records, args.records, capture, args.iterations)
    size = sum(p.stat().st_size for p in capture.glob("manifest_rank*.jsonl"))
    print(f"wrote {written:,} records, {size / 2**30:.2f} GiB of JSONL")
    first = report(capture, work / "draw1")
    again = report(capture, work / "draw1")          # the same command again: nothing new
    redraw = report(capture, work / "draw2")         # another folder: index reused, figures drawn
    goal = next((g for n, g in sorted(GOALS.items()) if args.records <= n), None)
    print(f"{'run':<34}{'wall (s)':>10}{'peak RSS (GiB)':>16}{'goal':>22}")
    for name, (wall, rss, _), g in (("first report", first, goal and (goal[0], goal[2])),
                                    ("again, nothing new", again, goal and (goal[1], goal[2])),
                                    ("into a new folder (index reused)", redraw, None)):
        print(f"{name:<34}{wall:>10.1f}{rss:>16.2f}{(f'<= {g[0]} s, <= {g[1]} GiB' if g else 'report'):>22}")
    print(f"header: {first[2]}")
    counted = int(re.match(r"([0-9,]+) records", first[2]).group(1).replace(",", ""))
    print(f"records counted by the report: {counted:,} of {written:,} written "
          f"({'all' if counted == written else 'MISSING SOME'})")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if counted == written else 1


if __name__ == "__main__":
    sys.exit(main())
