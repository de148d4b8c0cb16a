"""lowp-diagnose on a cluster-scale capture: wall time and peak memory at a chosen record count.

A genuine stats-only capture of the tiny Llama (bench_report_scale.genuine_capture: our training
driver on megatron-core) is replicated into ``manifest_rank*.jsonl`` files of many ranks and
iterations, in the capture's own layout, until the chosen number of records is reached, with
two planted problems: one rank's ``linear_fc1`` output turns NaN in one micro-batch of a late
iteration, and one ``linear_fc2`` weight's absmax doubles every iteration on every rank. Then
``lowp-diagnose --json`` runs in a child process, twice: the first run (the columnar index built
from scratch, then the queries) and again (the index current: the queries alone). Printed: wall
time and the child's peak RSS of each, against the issue's goal (1M records: <= 60 s,
<= 2 GiB), and whether findings[0] is the planted NaN and the drift is found.

    python bench/bench_diagnose.py --records 1000000
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

from lowp_common import CommandParser

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
GOALS = {1_000_000: (60.0, 2.0)}
NAN_RANK, DRIFT_MODULE = 5, "decoder.layers.1.mlp.linear_fc2"


def replicate(records: list[dict], total: int, out: Path, iterations: int) -> tuple[int, dict]:
    """``total`` records over ranks x ``iterations``; returns (written, the planted NaN's keys)."""
    out.mkdir(parents=True, exist_ok=True)
    base = [r for r in records if r.get("iteration") == records[0].get("iteration")]
    per_rank = len(base) * iterations
    ranks = -(-total // per_rank)
    nan_it = iterations - 3
    target = next(r for r in base if r["module_path"].endswith("layers.1.mlp.linear_fc1")
                  and r["tensor_name"] == "output" and r.get("sample_idx") in (None, 0))
    planted = {"rank": NAN_RANK, "iteration": nan_it, "module_path": target["module_path"],
               "tensor_name": "output", "operation": "forward", "sample_idx": target.get("sample_idx")}
    written = 0
    from tqdm import tqdm

    for rank in tqdm(range(ranks), desc="writing manifests", unit="rank"):
        lines = []
        counter = 0
        for it in range(iterations):
            for r in base:
                if written >= total:
                    break
                counter += 1
                rec = dict(r, rank=rank, iteration=it, file=None, counter=counter)
                stats = dict(rec.get("stats") or {})
                if rec["module_path"] == DRIFT_MODULE and rec["tensor_name"] == "weight":
                    stats["absmax"] = (stats.get("absmax") or 1.0) * 2.0 ** it
                if (rank, it) == (NAN_RANK, nan_it) and rec["module_path"] == target["module_path"] \
                        and rec["tensor_name"] == "output" and rec.get("sample_idx") == target.get("sample_idx") \
                        and rec["operation"] == "forward":
                    stats["nan_count"] = 17
                rec["stats"] = stats
                lines.append(json.dumps(rec))
                written += 1
        (out / f"manifest_rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return written, planted


def run_diagnose(capture: Path, out_json: Path) -> tuple[float, float]:
    """(wall seconds, child peak RSS in GiB) of one lowp-diagnose run."""
    script = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
              "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
              "w = time.perf_counter() - t; "
              "print(p.stdout[-3000:]); print(p.stderr[-3000:], file=sys.stderr); "
              "print('BENCH', w, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
              "sys.exit(p.returncode)")
    cmd = [sys.executable, "-c", script, sys.executable, "-m", "tensor_viz.diagnose.cli",
           str(capture), "--json", str(out_json)]
    res = subprocess.run(cmd, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if res.returncode != 0:
        raise SystemExit(f"bench_diagnose: lowp-diagnose failed:\n{res.stderr[-3000:]}")
    m = re.search(r"BENCH ([0-9.]+) ([0-9]+)", res.stdout)
    return float(m.group(1)), int(m.group(2)) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000, help="manifest records to write")
    ap.add_argument("--iterations", type=int, default=25, help="iterations per rank")
    ap.add_argument("--keep", default=None, help="folder to keep the capture in (default: a "
                    "temporary folder, removed afterwards)")
    args = ap.parse_args(argv)
    if args.records < 1 or args.iterations < 4:
        ap.error("--records must be at least 1 and --iterations at least 4")
    from bench_report_scale import genuine_capture

    work = Path(args.keep or tempfile.mkdtemp(prefix="bench_diagnose_"))
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    gen = work / "genuine.json"
    if gen.is_file():
        records = json.loads(gen.read_text())
    else:
        records = genuine_capture(work / "genuine", whatif=False)
        gen.write_text(json.dumps(records))
    print(f"genuine capture: {len(records)} records in {time.perf_counter() - t:.0f} s")
    capture = work / "scaled"
    shutil.rmtree(capture, ignore_errors=True)
    written, planted = replicate(records, args.records, capture, args.iterations)
    size = sum(p.stat().st_size for p in capture.glob("manifest_rank*.jsonl"))
    print(f"wrote {written:,} records over {len(list(capture.glob('manifest_rank*.jsonl')))} "
          f"ranks, {size / 2**30:.2f} GiB of JSONL")
    first = run_diagnose(capture, work / "first.json")
    again = run_diagnose(capture, work / "again.json")
    goal = next((g for n, g in sorted(GOALS.items()) if args.records <= n), None)
    print(f"{'run':<30}{'wall (s)':>10}{'peak RSS (GiB)':>16}{'goal':>24}")
    for name, (wall, rss) in (("index built + diagnosis", first), ("again (index current)", again)):
        g = f"<= {goal[0]:g} s, <= {goal[1]:g} GiB" if goal else ""
        print(f"{name:<30}{wall:>10.1f}{rss:>16.2f}{g:>24}")
    data = json.loads((work / "first.json").read_text())
    f0 = data["findings"][0] if data["findings"] else {}
    nan_ok = f0.get("kind") == "first_nonfinite" and all(
        f0.get(k) == v for k, v in planted.items())
    drift_ok = any(f["kind"] == "range_drift" and f["module_path"] == DRIFT_MODULE
                   for f in data["findings"])
    print(f"records diagnosed: {data['records']:,} of {written:,}; findings[0] is the planted "
          f"NaN: {nan_ok} ({f0.get('summary', 'none')}); the drift found: {drift_ok}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if (nan_ok and drift_ok and data["records"] == written) else 1


if __name__ == "__main__":
    sys.exit(main())
