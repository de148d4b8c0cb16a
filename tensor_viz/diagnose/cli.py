"""``lowp-diagnose CAPTURE_DIR``: the findings of a capture, the cause first (tensor_viz.diagnose).

Exit 0 when it ran, whatever it found; 2 on a usage error (one line on stderr, nothing written).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lowp_common import CommandParser, UserError, atomic_write_text, cli_entry, json_dumps
from lowp_common.outputs import refuse_overwrite


def _parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="lowp-diagnose",
        description="Name the cause of a low-precision run's trouble from its capture: the "
                    "first NaN/Inf and where it was born, the GEMM operands the run's own "
                    "format flushes or saturates, tensors drifting toward the format's "
                    "limits, tensors a format handles worse than Gaussian data, outlier ranks, "
                    "attention logit growth, loss spikes and divergence. Findings ranked, the "
                    "cause first; "
                    "docs/diagnose.md has the rules and the JSON schema.")
    p.add_argument("capture_dir", metavar="CAPTURE_DIR",
                   help="the folder the capture wrote (TENSOR_SAVE_DIR, with manifest_rank*.jsonl)")
    p.add_argument("--reference", metavar="DIR", default=None,
                   help="a capture of the same model in a reference precision: adds the first "
                        "tensor that departs from it")
    p.add_argument("--loss", metavar="LOG|TB_DIR", default=None,
                   help="the run's training log or TensorBoard folder: adds loss spikes, a "
                        "divergence or plateau by level and the finding each follows (a flight "
                        "recorder's folder brings its own losses: judged when this is not given)")
    p.add_argument("--json", metavar="FILE|-", default=None,
                   help="also write {findings, checked, records} as JSON to FILE ('-': stdout only)")
    p.add_argument("--index-dir", metavar="DIR", default=None,
                   help="where the columnar index goes (default: CAPTURE_DIR/.tensor_index)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="diagnose the records around torn or foreign manifest lines instead of "
                        "refusing")
    p.add_argument("--limit", type=int, default=20, help="findings printed (default %(default)s)")
    p.add_argument("--engine", choices=("duckdb", "spark"), default="duckdb",
                   help="where the queries run: duckdb (this machine, bounded memory; the "
                        "default) or spark (pip install -e \".[spark]\" plus a Java runtime): "
                        "the same kinds and findings")
    p.add_argument("--spark-master", metavar="URL", default=None,
                   help="the Spark cluster for --engine spark (default: local mode, local[2])")
    p.add_argument("--force", action="store_true",
                   help="replace the --json FILE of an earlier diagnosis")
    return p


@cli_entry("lowp-diagnose")
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.json not in (None, "-"):
        target = Path(args.json)
        if target.is_dir() or not target.parent.is_dir():
            raise UserError(f"--json {target}: not a file in an existing folder")
        refuse_overwrite([target], what="a diagnosis", force=args.force,
                         elsewhere="give another --json FILE")
    if args.spark_master is not None and args.engine != "spark":
        raise UserError("--spark-master: only with --engine spark")
    from tensor_viz.diagnose import diagnose

    def say(text: str) -> None:
        print(text, file=sys.stderr)

    result = diagnose(args.capture_dir, reference=args.reference, loss=args.loss,
                      cache_dir=args.index_dir, skip_bad_lines=args.skip_bad_lines, say=say,
                      engine=args.engine, spark_master=args.spark_master)
    text = json_dumps(result.to_json(), indent=2)
    if args.json == "-":
        print(text)
        return 0
    print("\n".join(result.lines(args.limit)))
    if args.json is not None:
        atomic_write_text(args.json, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
