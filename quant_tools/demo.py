"""quant-demo: quantize one tensor to every format and print error metrics and the analysis.

Without --input it builds a captured-like activation (bfloat16, a few outlier channels, as LLM
linear-layer inputs look); with --input it reads a captured .pt file safely.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from lowp_common import CommandParser, UserError, cli_entry, json_dumps
from quant import FORMATS, analyze_quantization, metrics, quantize
from quant.vocabulary import FormatNameError, check_format_name


def captured_like(rows: int = 256, cols: int = 1024, seed: int = 0) -> torch.Tensor:
    """A bf16 activation-like tensor: Gaussian body, a few large-magnitude channels, some tiny
    values (what makes low-precision formats overflow and flush)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    outliers = torch.randperm(cols, generator=g)[: max(1, cols // 128)]
    x[:, outliers] *= 60.0
    x[: rows // 8] *= 1e-4
    return x.to(torch.bfloat16)


def evaluate(x: torch.Tensor, formats) -> list[dict]:
    """One row per format: metrics (vs the float32 input) and analysis ratios."""
    rows = []
    ref = x.float()
    for name in formats:
        y = quantize(x, name)
        rep = analyze_quantization(x, name, quantized=y)
        row = {"format": name}
        row.update(metrics.all_metrics(ref, y.float()))
        row.update(flush_to_zero=rep.flush_to_zero_ratio, underflow=rep.underflow_ratio,
                   overflow=rep.overflow_ratio, severity=rep.underflow_severity)
        rows.append(row)
    return rows


def _print_table(rows: list[dict], out) -> None:
    print(f"{'format':<16} {'sqnr dB':>8} {'cosine':>9} {'rel err':>8} {'flush0':>8} "
          f"{'underfl':>8} {'overfl':>8}  severity", file=out)
    for r in rows:
        print(f"{r['format']:<16} {r['sqnr']:8.2f} {r['cosine_similarity']:9.6f} "
              f"{r['relative_error']:8.2%} {r['flush_to_zero']:8.3%} {r['underflow']:8.3%} "
              f"{r['overflow']:8.3%}  {r['severity']}", file=out)


def load_input(path: str) -> torch.Tensor:
    """A captured / saved tensor as a non-empty floating-point tensor (float64 -> float32)."""
    from tensor_capture.schema import load_tensor_file

    try:
        x, _meta = load_tensor_file(path)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if not torch.is_floating_point(x) or x.numel() == 0:
        raise UserError(f"{path}: needs a non-empty floating-point tensor")
    return x.float() if x.dtype == torch.float64 else x


@cli_entry("quant-demo")
def main(argv: Optional[list] = None) -> int:
    ap = CommandParser(prog="quant-demo", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", help="a captured tensor file (.pt); default: a built-in "
                    "captured-like activation")
    ap.add_argument("--formats", nargs="+", default=[n for n in FORMATS if n != "fp32"],
                    help="format names (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the built-in tensor")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    try:
        args.formats = [check_format_name(f, "--formats", high_precision=False) for f in args.formats]
    except FormatNameError as exc:
        raise UserError(str(exc)) from None
    if args.input:
        x, source = load_input(args.input), args.input
    else:
        x = captured_like(seed=args.seed)
        source = "built-in captured-like activation"
    rows = evaluate(x, args.formats)
    if args.json:
        print(json_dumps({"source": source, "shape": list(x.shape), "dtype": str(x.dtype),
                          "results": rows}, indent=1))
    else:
        print(f"{source}: shape {tuple(x.shape)}, {x.dtype}")
        _print_table(rows, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
