"""Full visualization report of a large capture vs the naive way (load every value).

Generates N tensor files (default 2,000, >= 1 GiB in all) through the real TensorSaver in a
temporary directory, then times two child processes on the same directory:

- ours: ``python -m tensor_viz.full`` (stats from the manifest; values read only from a
  seeded sample of files, one file at a time, in 2 worker processes; every figure + index.html);
- baseline (the naive way): load every tensor fully into memory, compute per-file statistics
  from the values, concatenate everything, draw the quick view and per-group histograms from
  all values. It draws fewer figures than ours, so the ratio understates the difference.

Peak memory = the largest sum of RSS over the child's process tree, sampled every 50 ms (shared
copy-on-write pages of forked workers count once per process, so this over-states ours), and
the largest single-process max RSS from getrusage. The directory is deleted afterwards.

    python bench/bench_report.py              # 2,000 files, ~1.1 GiB
    python bench/bench_report.py --files 200  # quicker look
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

from lowp_common import CommandParser, HelpWithDefaults

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GOAL_SECONDS = 60.0
GOAL_BYTES = 2 * 1024 ** 3
# Every tensor has 147,456 float32 values (576 KiB), in the layouts Megatron uses.
SHAPES = {"query": (128, 2, 9, 64), "key": (128, 2, 9, 64), "value": (128, 2, 9, 64),
          "context": (128, 2, 576), "input": (128, 2, 576), "weight": (576, 256), "output": (128, 2, 576),
          "grad_output": (128, 2, 576), "grad_input": (128, 2, 576)}
SPECS = [("attention", "forward", n) for n in ("query", "key", "value", "context")] + \
        [("linear", "forward", n) for n in ("input", "weight", "output")] + \
        [("linear", "backward", n) for n in ("grad_output", "grad_input")]


def _plan(files: int, layers: int) -> list[tuple]:
    """(iteration, quant type, layer, layer type, operation, tensor name, variant) per file."""
    plan: list[tuple] = []
    it = 0
    while len(plan) < files:
        for qt in ("hifp8", "mxfp8"):
            for layer in range(layers):
                for layer_type, op, name in SPECS:
                    plan.append((it, qt, layer, layer_type, op, name, "hp"))
                    if name == "input" and it == 0:
                        plan.append((it, qt, layer, layer_type, op, name, "quantized"))
        it += 1
    return plan[:files]


def _generate_part(directory: str, items: list[tuple], seed: int) -> None:
    import torch

    from tensor_capture.saver import TensorSaver

    torch.set_num_threads(1)
    saver = TensorSaver(enabled=True, save_dir=directory, range_formats=("fp8_e4m3", "hifp8"))
    try:
        for it, qt, layer, layer_type, op, name, variant in items:
            g = torch.Generator().manual_seed(seed + zlib.crc32(repr((it, qt, layer, name, variant)).encode()))
            scale = (1e-3 if op == "backward" else 1.0) * (1 + 0.3 * layer) * (1 + 0.05 * it)
            t = torch.randn(SHAPES[name], generator=g) * scale
            if name == "output":
                t.view(-1)[:64] *= 300.0             # outlier channel
            if variant == "quantized":
                t = t.to(torch.bfloat16).float()
            saver.save_tensor(t, layer_type, op, quant_type=qt, tensor_name=name, layer_idx=layer, phase="pre",
                              component="FA" if layer_type == "attention" else "linear", rank=0, sample_idx=0,
                              iteration=it, module_path=f"decoder.layers.{layer}.{layer_type}", variant=variant)
    finally:
        saver.close()


def generate(directory: Path, files: int, layers: int = 8, seed: int = 0, procs: int = 2) -> int:
    """Write ``files`` tensors through the real saver (``procs`` processes, iterations split
    between them; names differ by iteration); returns the bytes on disk."""
    import multiprocessing as mp

    plan = _plan(files, layers)
    directory.mkdir(parents=True, exist_ok=True)
    parts = [[p for p in plan if p[0] % procs == k] for k in range(procs)]
    ctx = mp.get_context("fork")
    workers = [ctx.Process(target=_generate_part, args=(str(directory), part, seed)) for part in parts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
        if w.exitcode != 0:
            raise RuntimeError(f"generation worker failed (exit {w.exitcode})")
    return sum(p.stat().st_size for p in directory.iterdir())


def _tree_rss(root: int) -> int:
    """Sum of RSS (bytes) of ``root`` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            pid, ppid = int(entry), int(fields[1])
            rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            children.setdefault(ppid, []).append(pid)
        except (OSError, IndexError, ValueError):
            continue
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def measure(cmd: list[str], timeout: float) -> dict:
    """Wall time, peak process-tree RSS (sampled) and max single-process RSS of ``cmd``."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    before, cpu0 = r0.ru_maxrss, r0.ru_utime + r0.ru_stime
    env = dict(os.environ, MPLBACKEND="Agg")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        timed_out = True
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    after, cpu = r1.ru_maxrss, r1.ru_utime + r1.ru_stime - cpu0
    return {"wall": wall, "cpu": cpu, "peak_tree": peak[0], "max_single": max(after, before) * 1024, "rc": proc.returncode,
            "timed_out": timed_out, "output": out}


def baseline(tensor_dir: str, out_dir: str) -> int:
    """The naive way: every value of every file in memory, statistics and plots from them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from tensor_capture import schema

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arrays, names, per_file = [], [], []
    for p in sorted(Path(tensor_dir).glob("*.pt")):
        t, _ = schema.load_tensor_file(p)
        a = t.float().numpy().reshape(-1)
        arrays.append(a)
        names.append(schema.parse_filename(p.name))
        per_file.append((a.min(), a.max(), a.mean(), a.std(), float((np.abs(a) > 448).mean())))
    allv = np.concatenate(arrays)
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    axes[0, 0].hist(allv, bins=100)
    axes[0, 0].set_yscale("log")
    for ax, key in zip((axes[0, 1], axes[1, 0], axes[1, 1]), ("quant_type", "layer_type", "operation")):
        from collections import Counter

        c = Counter(getattr(n, key) for n in names)
        ax.pie(list(c.values()), labels=list(c))
    fig.savefig(out / "quick_analysis.png", dpi=90)
    plt.close(fig)
    groups: dict[str, list[np.ndarray]] = {}
    for n, a in zip(names, arrays):
        groups.setdefault(f"{n.quant_type} {n.operation} {n.tensor_name}", []).append(a)
    keys = sorted(groups)[:12]
    fig, axes = plt.subplots(4, 3, figsize=(14, 13))
    for ax, k in zip(axes.ravel(), keys):
        ax.hist(np.concatenate(groups[k]), bins=80)
        ax.set_yscale("log")
        ax.set_title(k)
    fig.savefig(out / "value_histograms.png", dpi=90)
    plt.close(fig)
    print(f"baseline: {allv.size:,} values from {len(arrays)} files; {len(per_file)} per-file stats")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(description=__doc__.split("\n\n")[0],
                       formatter_class=HelpWithDefaults)
    ap.add_argument("--files", type=int, default=2000, help="tensor files to generate")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed to each side")
    ap.add_argument("--keep", action="store_true", help="keep the generated directory and outputs")
    ap.add_argument("--baseline", nargs=2, metavar=("TENSOR_DIR", "OUT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.baseline:
        return baseline(*args.baseline)
    if args.files < 1:
        print("bench_report: --files must be at least 1", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="bench_report_"))
    try:
        cap = root / "cap"
        t0 = time.perf_counter()
        size = generate(cap, args.files)
        print(f"generated {args.files} files, {size / 2 ** 30:.2f} GiB in {time.perf_counter() - t0:.0f} s ({cap})")
        ours = measure([sys.executable, "-m", "tensor_viz.full", "--tensor_dir", str(cap), "--output_dir",
                        str(root / "ours"), "--no-progress"], args.timeout)
        print(ours["output"].strip())
        base = measure([sys.executable, str(Path(__file__).resolve()), "--baseline", str(cap), str(root / "base")],
                       args.timeout)
        print(base["output"].strip()[-2000:])
        gib = 2 ** 30
        rows = [("ours (tensor_viz.full)", ours), ("baseline (load every value)", base)]
        print(f"\nload average before: {os.getloadavg()[0]:.1f} (other work on the machine inflates wall time)")
        print(f"{'':30s} {'wall s':>9s} {'cpu s':>7s} {'peak tree RSS GiB':>18s} {'max 1-proc RSS GiB':>19s} {'rc':>4s}")
        for label, r in rows:
            wall = f"{r['wall']:.1f}" + ("+" if r["timed_out"] else "")
            print(f"{label:30s} {wall:>9s} {r['cpu']:>7.1f} {r['peak_tree'] / gib:>18.2f} {r['max_single'] / gib:>19.2f} {r['rc']:>4}")
        print(f"ratio baseline/ours: wall {base['wall'] / ours['wall']:.2f}x, cpu {base['cpu'] / ours['cpu']:.2f}x, "
              f"peak memory "
              f"{base['peak_tree'] / max(ours['peak_tree'], 1):.2f}x")
        ok = ours["rc"] == 0 and ours["wall"] <= GOAL_SECONDS and ours["peak_tree"] <= GOAL_BYTES
        print(f"goal (<= {GOAL_SECONDS:.0f} s, <= 2 GiB, exit 0): {'met' if ok else 'NOT met'}")
        if args.keep:
            print(f"kept {root}")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
