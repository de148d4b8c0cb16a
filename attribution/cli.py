"""lowp-attribute: which GEMM of which layers costs the loss gap, and the cheapest plan closing it.

Thin over attribution.attribute (the runs), attribution.stats (the arithmetic) and
attribution.report (what is written).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from lowp_common import (
    CommandParser,
    HelpWithDefaults,
    UserError,
    atomic_write_json,
    atomic_write_text,
    check_writable,
    cli_entry,
    refuse_overwrite,
)

PROG = "lowp-attribute"


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog=PROG, formatter_class=HelpWithDefaults,
        description="Train the reference and the low-precision format, then ablations keeping "
                    "one part in high precision (each GEMM role, the backward GEMMs, layer "
                    "groups, then bisection), each over seeds; report which part costs the loss "
                    "gap (above seed noise only) and write the precision plan that closes the "
                    "target share at the least high-precision compute. Without --data-path / "
                    "--tokenizer: the embedded default (tiny Llama, corpus built from Python's "
                    "own documentation).")
    p.add_argument("--format", required=True, help="format or recipe under test (quant.recipes "
                   "name, e.g. fp8_e4m3, mxfp4, te_mxfp8)")
    p.add_argument("--against", default="bf16", help="reference format: what 'high precision' "
                   "means in every ablation")
    p.add_argument("--data-path", default=None, help="indexed dataset prefix (preprocess-corpus)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory of that dataset")
    p.add_argument("--model", default="tiny", help="model shape of llama-train (tiny, "
                   "llama32_1b)")
    p.add_argument("--steps", type=int, default=150, help="training steps per run")
    p.add_argument("--seeds", default="3", help="number of seeds, or a list like 1,2,3")
    p.add_argument("--resume", default=None, metavar="CKPT",
                   help="start every run from the latest checkpoint in this llama-train "
                        "--checkpoint-dir (same model and tokenizer)")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes (one core each)")
    p.add_argument("--target", type=float, default=0.9, help="share of the gap the plan must "
                   "close")
    p.add_argument("--bisect-rounds", type=int, default=4, help="most halvings measured "
                   "while bisecting (each: 2 runs per seed)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not run the written plan again on fresh seeds")
    p.add_argument("--out", default=None, help="output folder (default runs/attribute/"
                   "FORMAT_vs_AGAINST)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result here")
    p.add_argument("--force", action="store_true",
                   help="replace the plan and results an earlier run wrote into --out (and "
                        "--json); without it such a run refuses before training anything")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    return p


def _seeds(text: str) -> list[int]:
    try:
        items = [int(t) for t in str(text).replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--seeds {text!r}: give a count (3) or a list (1,2,3)") from None
    seeds = list(range(1, items[0] + 1)) if len(items) == 1 else items
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {text!r}: at least 2 distinct seeds are needed to tell a gap "
                        "from seed noise")
    return seeds


def _check_args(args) -> None:
    from quant.precision_plan import PlanError, check_format
    from training_driver.train import MODEL_SHAPES

    try:
        args.format = check_format(args.format, "--format")
        args.against = check_format(args.against, "--against")
    except PlanError as exc:
        raise UserError(str(exc)) from None
    if args.format == args.against:
        raise UserError(f"--format and --against are both {args.format}: nothing to compare")
    if args.model not in MODEL_SHAPES:
        raise UserError(f"--model {args.model!r} is unknown: choose one of "
                        f"{', '.join(MODEL_SHAPES)}")
    if (args.data_path is None) != (args.tokenizer is None):
        raise UserError("--data-path and --tokenizer go together (the tokenizer the data was "
                        "made with); give both, or neither for the embedded default")
    for name in ("steps", "workers", "bisect_rounds", "micro_batch_size"):
        if getattr(args, name) < (0 if name == "bisect_rounds" else 1):
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.target <= 1:
        raise UserError(f"--target {args.target}: a share in (0, 1]")
    if args.resume and not Path(args.resume).is_dir():
        raise UserError(f"--resume {args.resume}: no such checkpoint folder")


#: what a run writes into --out: an earlier run's are its result, never replaced silently
RESULT_FILES = ("precision_plan.yaml", "attribution.json", "attribution.png",
                "te_precision_config.yaml")


def _out_dir(args) -> Path:
    """--out (default runs/attribute/FORMAT_vs_AGAINST), refused before any training when it
    holds an earlier run's plan or results and --force is not given (issue 40: a typo re-ran
    the experiment and replaced a 150-step plan)."""
    out = Path(args.out or f"runs/attribute/{args.format}_vs_{args.against}")
    check_writable(out, "--out", folder=True)
    earlier = [out / name for name in RESULT_FILES]
    if args.json:
        check_writable(args.json, "--json")
        earlier.append(Path(args.json))
    refuse_overwrite(earlier, what="a lowp-attribute result", force=args.force,
                     elsewhere="give another --out DIR" + (" / --json FILE" if args.json else ""))
    return out


def _data(args) -> tuple[str, str]:
    if args.data_path:
        return args.data_path, args.tokenizer
    from training_driver.collector import prepare_default_data

    d = prepare_default_data("runs/default")
    return d["data_path"], d["tokenizer"]


def _shape(args, tokenizer: str):
    from training_driver import preflight
    from training_driver.data.tokenizer import load_tokenizer
    from training_driver.train import MODEL_SHAPES

    from .ablations import ModelShape

    vocab = preflight.padded_vocab_size(load_tokenizer(tokenizer).vocab_size, 128, 1)
    return ModelShape(vocab_size=vocab, **MODEL_SHAPES[args.model])


def _megatron(res, out: Path, say) -> Optional[Path]:
    """Megatron-LM's --te-precision-config-file for the plan, when it can express it."""
    import yaml

    from quant.precision_plan import PlanSite, load_plan

    from .megatron_config import to_megatron

    sites = []
    for i in range(res.shape.num_layers):
        for sub in ("self_attention.linear_qkv", "self_attention.linear_proj",
                    "mlp.linear_fc1", "mlp.linear_fc2"):
            sites.append(PlanSite(f"decoder.layers.{i}.{sub}", i))
    sites.append(PlanSite("output_layer", None))
    try:
        cfg = to_megatron(load_plan(res.plan_path), sites, res.fmt)
    except UserError as exc:
        say(f"Megatron-LM config: not written: {exc}")
        return None
    path = out / "te_precision_config.yaml"
    atomic_write_text(path, "# Megatron-LM --te-precision-config-file (lowp-attribute)\n"
                      + yaml.safe_dump(cfg, sort_keys=False))
    return path


@cli_entry(PROG)
def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    seeds = _seeds(args.seeds)
    out = _out_dir(args)

    def say(line: str) -> None:
        print(f"{PROG}: {line}", file=sys.stderr, flush=True)

    from training_driver.capture import PATCHED_DIR_ENV, prepare_patched_tree

    from . import report
    from .attribute import Orchestrator, tqdm_bar
    from .runner import RunSetup, WorkerPool

    data_path, tokenizer = _data(args)
    shape = _shape(args, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    ready = os.environ.get(PATCHED_DIR_ENV)      # a launcher prepared one already
    patched = Path(ready) if ready else prepare_patched_tree("runs/.patched_megatron")
    if patched is None:
        raise UserError("the capture patch set (tensor_capture) is not installed: emulation "
                        "needs it")
    setup = RunSetup(data_path, tokenizer, args.model, args.steps, args.micro_batch_size,
                     lr=args.lr, resume=args.resume, patched_dir=str(patched))
    say(f"{args.format} against {args.against}: {args.model} model, {args.steps} steps, seeds "
        f"{seeds}, {args.workers} worker(s), data {data_path}")
    pool = WorkerPool(setup, args.workers)
    try:
        orch = Orchestrator(setup, shape, args.format, args.against, seeds, out, args.workers,
                            args.target, args.bisect_rounds, args.verify, say, tqdm_bar)
        res = orch.run(pool)
    finally:
        pool.close()
    result = report.to_json(res)
    fig = report.figure(res, out / "attribution.png")
    mega = _megatron(res, out, say) if res.significant and res.plan_path else None
    result["files"] = {"figure": str(fig) if fig else None, "plan": res.plan_path,
                       "megatron_config": str(mega) if mega else None}
    atomic_write_json(out / "attribution.json", result)
    if args.json:
        atomic_write_json(args.json, result, make_parents=True)
    print(report.table(res))
    runs = len(res.run_seconds)
    say(f"done in {res.seconds / 60:.1f} min ({runs} runs, "
        f"{(sum(res.run_seconds) / max(runs, 1)):.1f} s per run per worker); files in {out}"
        + (f"; figure {fig}" if fig else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
