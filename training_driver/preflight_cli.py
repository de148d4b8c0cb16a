"""The launcher's preflight command (``python -m training_driver.preflight_cli``) and the check
of a llama-train command line; the estimates and checks themselves are in ``preflight``.

A module of its own because it reads llama-train's parser (``train``), which itself calls
``preflight``: keeping the two apart keeps the imports one-way.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Mapping, Sequence

from lowp_common.cli import CommandParser, cli_entry

from .preflight import (
    REMEDY,
    RunEstimate,
    check_inputs,
    check_training_run,
    padded_vocab_size,
    recipe_plan,
)


def check_training_args(train_args: Sequence[str], ranks: int, remedy: str = "",
                        world_size: int | None = None, env: Mapping[str, str] | None = None,
                        say: Any = None) -> RunEstimate:
    """The same from llama-train's command-line arguments (the collector's and the
    launcher's view), before any training process starts."""
    from .data.tokenizer import load_tokenizer
    from .megatron_env import cuda_available
    from .train import build_parser, check_config, config_from_args

    cfg = config_from_args(build_parser().parse_args(list(train_args)))
    derived = check_config(cfg, world_size or ranks, cuda_available(), capture=False)
    vocab = padded_vocab_size(load_tokenizer(cfg.tokenizer).vocab_size,
                              cfg.make_vocab_size_divisible_by, cfg.tensor_model_parallel_size)
    return check_training_run(cfg, derived, vocab, ranks, remedy, env, say)


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="preflight", description="Checks before training starts "
                      "(used by examples/llama/train_llama32_1b_h100_fp8.sh).")
    sub = p.add_subparsers(dest="what", required=True)
    inputs = sub.add_parser("inputs", help="capture settings, tokenizer, data; prints "
                                           "'ok CAPTURE QUANT'")
    inputs.add_argument("tokenizer")
    inputs.add_argument("data_path")
    res = sub.add_parser("resources", help="memory and capture size of llama-train ARGS")
    res.add_argument("--ranks", type=int, default=1, help="training processes on this node")
    res.add_argument("--world-size", type=int, default=None, help="on all nodes (default: --ranks)")
    res.add_argument("--remedy", default=REMEDY,
                     help="what the message says after the numbers: the caller's settings and "
                          "its flag that skips this check")
    res.add_argument("--prog", default="preflight", help="name on the note line")
    res.add_argument("train_args", nargs=argparse.REMAINDER, help="-- llama-train arguments")
    rec = sub.add_parser("recipe", help="how a Megatron-LM recipe runs here: prints 'native "
                                        "FLAG VALUE', 'emulate RECIPE' or 'none -'")
    rec.add_argument("--fp8-recipe", default=None, help="Megatron-LM's --fp8-recipe value")
    rec.add_argument("--fp4-recipe", default=None, help="Megatron-LM's --fp4-recipe value")
    rec.add_argument("--dtype", default="bf16", help="the launcher's DTYPE (bf16: emulate)")
    return p


def _gpu() -> tuple[tuple[int, int] | None, bool]:
    """(compute capability of GPU 0 or None, whether Transformer Engine imports)."""
    import torch

    from .train_config import _te_available

    if not torch.cuda.is_available():
        return None, False
    return tuple(torch.cuda.get_device_capability(0)), _te_available()


@cli_entry("preflight")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.what == "recipe":
        capability, te = _gpu()
        print(*recipe_plan(args.fp8_recipe or None, args.fp4_recipe or None, args.dtype,
                           capability, te))
        return 0
    if args.what == "inputs":
        capture, quant = check_inputs(args.tokenizer, args.data_path)
        print("ok", int(capture), quant or "-")
        return 0
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    check_training_args(train_args, max(1, args.ranks), args.remedy, args.world_size,
                         say=lambda line: print(f"{args.prog}: {line}", file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
