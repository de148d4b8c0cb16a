"""Does lowp-diagnose agree with lowp-attribute on the embedded default? (docs/diagnose.md)

For each format (default: unscaled fp8_e4m3 and the default what-if set): the gap to bf16 as
lowp-attribute measures it (the same runner: tiny Llama, --steps, seeds 1..N, the final loss
averaged over the last quarter; significant when above t x its standard error), and the
diagnosis of a stats-only capture of one run in that format (seed 1, --capture-iters
iterations, the format's what-if numbers stored, the training log as --loss). Prints one
markdown row per format and writes everything to OUT/agreement.json.

    python bench/diagnose_agreement.py [--formats fp8_e4m3,mxfp8] [--steps 150] [--seeds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _capture(fmt: str, data: str, tok: str, patched: str, out: Path, iters: int) -> Path:
    cfg = out / f"{fmt}.yaml"
    cfg.write_text("stats_only: true\nmax_iterations: unlimited\n"
                   f"whatif_formats: [{fmt}]\nwhatif_budget: unlimited\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TENSOR_SAVE", "CUSTOM_QUANT", "MASTER_PORT"))}
    env.update(TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(out / fmt),
               TENSOR_SAVE_CONFIG=str(cfg), CUSTOM_QUANT_TYPE=fmt,
               MEGATRON_LOWP_PATCHED_DIR=patched, PYTHONPATH=str(ROOT),
               PYTHONWARNINGS="ignore")
    log = out / f"{fmt}.log"
    proc = subprocess.run([sys.executable, "-m", "training_driver.train", "--data-path", data,
                           "--tokenizer", tok, "--model", "tiny", "--train-iters", str(iters),
                           "--seed", "1", "--log-interval", "1"], env=env, capture_output=True,
                          text=True, cwd=out)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"llama-train {fmt}: {proc.stderr[-2000:]}")
    return log


def _row(fmt: str, row: dict, out: Path) -> dict:
    """Diagnose the format's capture, print its markdown row; ``row`` with the diagnosis."""
    from tensor_viz.diagnose import diagnose

    diag = diagnose(out / fmt, loss=out / f"{fmt}.log")
    highs = [f for f in diag.findings if f.severity == "HIGH"]
    first = diag.findings[0].to_dict() if diag.findings else None
    row.update(high=len(highs), findings=len(diag.findings), first=first,
               high_kinds=sorted({f.kind for f in highs}))
    lead = (f"{first['severity']} {first['kind']} {first['module_path']} "
            f"{first['operation']} {first['tensor_name']} "
            f"{'/'.join(first['evidence'].get('gemms', []))}" if first else "none")
    print(f"| `{fmt}` | {row['gap_mean']:+.3f} +- {row['gap_std']:.3f} | "
          f"{'significant' if row['significant'] else 'not significant'} | {len(highs)} "
          f"({', '.join(row['high_kinds']) or '-'}) | {lead} |", flush=True)
    return row


def main() -> int:
    from quant.formats import WHATIF_FORMATS

    p = argparse.ArgumentParser(prog="diagnose_agreement", allow_abbrev=False)
    p.add_argument("--formats", default=",".join(("fp8_e4m3",) + WHATIF_FORMATS))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--capture-iters", type=int, default=30)
    p.add_argument("--out", default="runs/diagnose_agreement")
    p.add_argument("--diagnose-only", action="store_true",
                   help="diagnose OUT's captures again against OUT/agreement.json's gaps")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.diagnose_only:
        saved = json.loads((out / "agreement.json").read_text())
        for fmt, row in saved["formats"].items():
            _row(fmt, row, out)
        return 0
    from attribution.runner import RunSetup, RunTask, WorkerPool
    from attribution.stats import gap_summary
    from training_driver.capture import prepare_patched_tree
    from training_driver.collector import prepare_default_data

    d = prepare_default_data(str(ROOT / "runs" / "default"))
    data, tok = d["data_path"], d["tokenizer"]
    patched = str(prepare_patched_tree(out / "patched"))
    formats = args.formats.split(",")
    seeds = list(range(1, args.seeds + 1))
    t0 = time.time()
    pool = WorkerPool(RunSetup(data, tok, steps=args.steps, patched_dir=patched), 1)

    def losses_of(fmt: str) -> dict[int, float]:
        return {r.seed: r.loss for r in pool.map([RunTask(fmt, s, fmt) for s in seeds])}

    ref = losses_of("bf16")
    result: dict = {"steps": args.steps, "seeds": seeds, "bf16": ref, "formats": {}}
    for fmt in formats:
        losses = losses_of(fmt)
        gap = gap_summary(losses, ref)
        _capture(fmt, data, tok, patched, out, args.capture_iters)
        row = {"gap_mean": gap.mean, "gap_std": gap.std, "significant": gap.significant,
               "losses": losses}
        result["formats"][fmt] = _row(fmt, row, out)
        (out / "agreement.json").write_text(json.dumps(result, indent=1, default=str))
    pool.close()
    print(f"{time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":  # spawned workers import this module: run only as the script
    sys.exit(main())
