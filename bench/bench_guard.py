"""The auto-guard on the embedded default: the loss gap it closes, the FLOPs it moves to high
precision, its wall time, and its cost over the flight recorder alone.

    python bench/bench_guard.py                       # fp8_e4m3, seeds 1 2, 150 steps
    python bench/bench_guard.py --formats fp8_e4m3 fp8_e5m2 --seeds 1 2 3
    python bench/bench_guard.py --cost --rounds 5     # step time: emulation, + recorder, + guard

Gap: per seed and format, bf16, the format unguarded and the format guarded (TENSOR_SAVE_GUARD=on)
are trained for --steps in one worker process (attribution.runner: the steps of llama-train);
closure = (L_format - L_guarded) / (L_format - L_bf16), with the guard's summary.json
(decisions, hp_flops_share). Compare with ``lowp-attribute --format F --seeds ...`` (its
gap_closed, plan flops share and wall time) for the offline plan of the same question.

Cost: a healthy format (--cost-format, default mxfp8: the guard never acts) trained with
emulation alone, with the flight recorder, and with the recorder and the guard, interleaved round
by round in one process; medians of the per-step time of each run's second half, as ratios.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lowp_common import CommandParser, HelpWithDefaults


def _worker(steps: int, data: dict):
    from attribution.runner import RunSetup, _Worker

    return _Worker(RunSetup(data["data_path"], data["tokenizer"], steps=steps))


def gap(worker, formats: list[str], seeds: list[int], out: Path) -> None:
    import json

    from attribution.runner import RunTask
    from tensor_capture.guard import GUARD_DIR, SUMMARY_FILE

    print(f"{'format':<10} {'seed':>4} {'bf16':>7} {'format':>7} {'guarded':>7} {'closed':>7} "
          f"{'decisions':>9} {'hp FLOPs':>8} {'guarded s':>9}")
    for fmt in formats:
        for seed in seeds:
            folder = out / f"{fmt}_{seed}"
            ref = worker.run(RunTask("bf16", seed, "bf16")).loss
            plain = worker.run(RunTask(fmt, seed, fmt)).loss
            t0 = time.perf_counter()
            guarded = worker.run(RunTask("guarded", seed, fmt, capture_env=(
                ("TENSOR_SAVE_GUARD", "on"), ("TENSOR_SAVE_DIR", str(folder))))).loss
            wall = time.perf_counter() - t0
            s = json.loads((folder / GUARD_DIR / SUMMARY_FILE).read_text())
            closed = (plain - guarded) / (plain - ref) if plain != ref else float("nan")
            print(f"{fmt:<10} {seed:>4} {ref:>7.3f} {plain:>7.3f} {guarded:>7.3f} {closed:>7.2f} "
                  f"{s['decisions']:>9} {s['hp_flops_share']:>8.3f} {wall:>9.1f}", flush=True)


def cost(worker, fmt: str, rounds: int, out: Path) -> None:
    from attribution.runner import RunTask

    variants = {"emulation": (),
                "recorder": (("TENSOR_SAVE_MODE", "recorder"), ("TENSOR_SAVE_DIR", str(out / "r"))),
                "guard": (("TENSOR_SAVE_GUARD", "on"), ("TENSOR_SAVE_DIR", str(out / "g")))}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        for name, env in variants.items():
            res = worker.run(RunTask(name, 1, fmt, capture_env=env))
            times[name].append(res.step_seconds)
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{fmt}, median ms/step: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in med.items()))
    print(f"recorder / emulation {med['recorder'] / med['emulation']:.3f}x; guard+recorder / "
          f"recorder {med['guard'] / med['recorder']:.3f}x; guard+recorder / emulation "
          f"{med['guard'] / med['emulation']:.3f}x")


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(description=__doc__.splitlines()[0], formatter_class=HelpWithDefaults)
    p.add_argument("--formats", nargs="+", default=["fp8_e4m3"], help="formats to guard")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--steps", type=int, default=150, help="training steps per run")
    p.add_argument("--cost", action="store_true", help="measure step time instead of the gap")
    p.add_argument("--cost-format", default="mxfp8", help="a format the guard leaves alone")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds for --cost")
    p.add_argument("--data-dir", default="runs/default",
                   help="where the embedded default corpus is built (or found)")
    args = p.parse_args(argv)
    os.environ["QUANT_COMPILE"] = "0"
    import torch

    from training_driver.collector import prepare_default_data

    torch.set_num_threads(1)
    worker = _worker(args.steps, prepare_default_data(args.data_dir))
    with tempfile.TemporaryDirectory() as tmp:
        if args.cost:
            cost(worker, args.cost_format, args.rounds, Path(tmp))
        else:
            gap(worker, args.formats, args.seeds, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
