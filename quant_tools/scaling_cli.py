"""mxfp-scaling-test: sweep MXFP scale exponents over saved tensors and recommend one.

The application over ``quant.scaling_sweep`` (the numerics: kernel, scoring, analyses):
input files, the console + file log, the results file (``quant_tools.scaling_report``), the
figures (``tensor_viz.scaling_plots``) and the JSON document. Run as the installed
``mxfp-scaling-test`` or, at the original script path, ``python quant/mxfp_scaling_test.py T1.pt ...``
(a shim that calls :func:`main`). See docs/scaling.md.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
import traceback
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from lowp_common import (
    EXIT_USER_ERROR,
    CommandParser,
    UserError,
    atomic_write_text,
    cli_entry,
    json_dumps,
)

DEFAULT_ROOT = os.path.join("draw", "scaling_analysis")
LOG_FORMAT = "%(asctime)s - %(levelname)s - %(message)s"
RULE = "=" * 80
DASH = "-" * 60

#: file suffix -> loader name (see load_input)
LOADERS = {".npy": "numpy", ".safetensors": "safetensors"}


class InputError(UserError):
    """A user mistake about one input file (one-line message)."""


def build_parser() -> argparse.ArgumentParser:
    from quant.scaling_sweep import ELEMENT_FORMATS

    p = CommandParser(
        prog="mxfp-scaling-test",
        description="Test how one power-of-two scale per tensor affects quantization to an MX "
                    "element format: sweep scale exponents from max alignment "
                    "floor(log2(amax/max_normal)) to min alignment "
                    "ceil(log2(min_nonzero/min_normal)), compute MSE/RMSE/cosine/PSNR/MAE/max "
                    "error/relative error and overflow/underflow per level, and recommend one.",
        epilog="Inputs: tensor-saver files (dict with 'tensor'), plain saved tensors (.pt), "
               ".npy or .safetensors (one tensor); bf16 expected, any float accepted. "
               "Exit code 0 when every file succeeded, 2 when a file or an argument was the "
               "problem (one line on stderr), 1 when the tool failed.")
    p.add_argument("input_tensor", nargs="+", help="tensor file(s) to test")
    p.add_argument("--output-dir", default=None,
                   help=f"output directory (default {DEFAULT_ROOT}/<tensor_name>/; with several "
                        "inputs, one sub-directory per tensor inside it)")
    p.add_argument("--elem-format", default="fp8_e4m3", choices=ELEMENT_FORMATS,
                   help="element format (default fp8_e4m3)")
    p.add_argument("--scale-bits", type=int, default=8,
                   help="bits of the E*M0 shared scale; exponents are clipped to its range "
                        "(default 8: [-127, 127])")
    p.add_argument("--max-scale-exp", type=float, default=None,
                   help="largest scale exponent (default: max alignment of each tensor)")
    p.add_argument("--min-scale-exp", type=float, default=None,
                   help="smallest scale exponent (default: min alignment of each tensor)")
    p.add_argument("--num-levels", type=int, default=21,
                   help="number of evenly spaced exponents to test (default 21)")
    p.add_argument("--no-plots", action="store_true", help="skip the figures")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write all results as JSON to PATH ('-' for stdout; the console "
                        "log then goes to stderr)")
    p.add_argument("--force", action="store_true",
                   help="replace the results, log and figures an earlier sweep of the same "
                        "tensor and format wrote (and --json PATH); without it such a run refuses")
    p.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    return p


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Argument mistakes that hold for every file: stop before doing any work."""
    from quant.scaling_sweep import SweepInputError, scale_exponent_limits

    if args.num_levels < 1:
        parser.error(f"--num-levels {args.num_levels}: must be at least 1 (default 21)")
    try:
        scale_exponent_limits(args.scale_bits)
    except SweepInputError as exc:
        parser.error(str(exc))
    lo, hi = args.min_scale_exp, args.max_scale_exp
    for flag, val in (("--min-scale-exp", lo), ("--max-scale-exp", hi)):
        if val is not None and not math.isfinite(val):
            parser.error(f"{flag} {val}: must be a finite number")
    if lo is not None and hi is not None and lo > hi:
        parser.error(f"--min-scale-exp {lo:g} is greater than --max-scale-exp {hi:g}; "
                     "swap them or widen the range")


def output_files(name: str, fmt: str) -> tuple[str, ...]:
    """The files one sweep writes into its output directory (the log, results, figures)."""
    return (f"mxfp_scaling_test_{name}_{fmt}.log", f"mxfp_scaling_results_{fmt}.txt",
            f"mxfp_scaling_test_{fmt}.png", f"mxfp_scaling_summary_{fmt}.png")


def check_inputs_and_outputs(args: argparse.Namespace) -> None:
    """Every mistake that needs no sweep, before the first banner line: (one input) a missing,
    unreadable or unloadable file, an output that cannot be written, and a result an earlier
    sweep wrote (replaced only with --force: issue 40). One input is loaded here once and kept
    for the sweep (``args.loaded``), so a corrupt file is one line, not a summary."""
    from lowp_common import check_writable, refuse_overwrite

    several = len(args.input_tensor) > 1
    if not several:     # several: a bad file is one row of the summary; the others go on
        check_readable(args.input_tensor[0])
    earlier = []
    for name in tensor_names(args.input_tensor):
        out_dir = output_dir_for(name, args.output_dir, several)
        check_writable(out_dir, "--output-dir", folder=True)
        earlier += [os.path.join(out_dir, f) for f in output_files(name, args.elem_format)]
    if args.json not in (None, "-"):
        check_writable(args.json, "--json")
        earlier.append(args.json)
    refuse_overwrite(earlier, what="a sweep's result", force=args.force,
                     elsewhere="give another --output-dir / --json")
    args.loaded = {}
    if not several:
        args.loaded[args.input_tensor[0]] = load_input(args.input_tensor[0])


# --------------------------------------------------------------------------------------
# input


def check_readable(path: str) -> None:
    """Missing, a directory, unreadable or 0 bytes: say so before any work."""
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file; check the path")
    if os.path.isdir(path):
        raise InputError(f"{path}: is a directory; pass tensor files (e.g. {path}/*.pt)")
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: not readable (permission denied); check its permissions")
    if os.path.getsize(path) == 0:
        raise InputError(f"{path}: the file is empty (0 bytes); re-save the tensor")


def load_input(path: str) -> Any:
    """The tensor in ``path``: saver dict / plain tensor via tensor_capture.schema
    (weights_only), ``.npy`` without pickles, ``.safetensors`` holding one tensor."""
    check_readable(path)
    kind = LOADERS.get(Path(path).suffix.lower(), "torch")
    if kind == "numpy":
        return _load_numpy(path)
    if kind == "safetensors":
        return _load_safetensors(path)
    from tensor_capture.schema import load_tensor_file

    try:
        tensor, _meta = load_tensor_file(path)
    except ValueError as exc:
        if not zipfile.is_zipfile(path):  # not what torch.save writes: say that, plainly
            raise InputError(f"{path}: not a PyTorch tensor file (torch.save archive), .npy or "
                             ".safetensors file; check the file or re-save the tensor") from None
        raise InputError(str(exc)) from None
    return tensor


def _load_numpy(path: str) -> Any:
    import numpy as np
    import torch

    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as exc:  # corrupt, or an object array that would need pickle
        raise InputError(f"{path}: cannot be read as a .npy array ({_reason(exc)})") from None
    if not isinstance(arr, np.ndarray):
        raise InputError(f"{path}: holds {type(arr).__name__}, not one array; save one array "
                         "with numpy.save")
    if arr.dtype.kind not in "fiub":
        raise InputError(f"{path}: holds a {arr.dtype} array; save a float array")
    return torch.from_numpy(np.ascontiguousarray(arr))


def _load_safetensors(path: str) -> Any:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise InputError(f"{path}: reading .safetensors needs the safetensors package "
                         "(pip install safetensors)") from None
    try:
        tensors = load_file(path, device="cpu")
    except Exception as exc:
        raise InputError(f"{path}: cannot be read as safetensors ({_reason(exc)})") from None
    if "tensor" in tensors:
        return tensors["tensor"]
    if len(tensors) != 1:
        names = ", ".join(sorted(tensors)[:5]) + (" ..." if len(tensors) > 5 else "")
        raise InputError(f"{path}: holds {len(tensors)} tensors ({names or 'none'}); save one "
                         "tensor per file, or name it 'tensor'")
    return next(iter(tensors.values()))


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


# --------------------------------------------------------------------------------------
# one tensor


@dataclass
class Outcome:
    path: str
    tensor_name: str
    output_dir: str
    ok: bool = False
    error: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    result: Any = None
    seconds: float = 0.0
    user_error: bool = False     # the file was the problem (exit 2), not the tool (exit 1)

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.path, "tensor_name": self.tensor_name, "ok": self.ok,
                "error": self.error, "output_dir": self.output_dir, "files": self.files,
                "seconds": round(self.seconds, 3),
                "result": None if self.result is None else self.result.to_dict()}


def tensor_names(paths: Sequence[str]) -> list[str]:
    """File stems, made unique (``name``, ``name_2``, ...) so outputs never collide."""
    seen: dict[str, int] = {}
    names = []
    for p in paths:
        stem = Path(p).name
        for suffix in (".safetensors", ".npy", ".pt", ".pth", ".bin"):
            if stem.lower().endswith(suffix):
                stem = stem[: -len(suffix)]
                break
        stem = stem or "tensor"
        seen[stem] = seen.get(stem, 0) + 1
        names.append(stem if seen[stem] == 1 else f"{stem}_{seen[stem]}")
    return names


def output_dir_for(name: str, output_dir: str | None, several: bool) -> str:
    if output_dir is None:
        return os.path.join(DEFAULT_ROOT, name)
    return os.path.join(output_dir, name) if several else output_dir


def _make_logger(idx: int, log_path: str, stream) -> logging.Logger:
    logger = logging.getLogger(f"mxfp_scaling_test.{idx}.{os.getpid()}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    fmt = logging.Formatter(LOG_FORMAT)
    console = logging.StreamHandler(stream)
    console.setFormatter(fmt)
    console.setLevel(logging.INFO)
    logger.addHandler(console)
    file_handler = logging.FileHandler(log_path, mode="w", encoding="utf-8")
    file_handler.setFormatter(fmt)
    logger.addHandler(file_handler)
    return logger


def _close_logger(logger: logging.Logger) -> None:
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()


class _Discard(Exception):
    """The sweep of one file failed (already logged): drop its staged outputs."""


def process_tensor(idx: int, path: str, name: str, args: argparse.Namespace, stream) -> Outcome:
    """Sweep one file: log (console + file), results text, figures. Never raises for bad
    input: the outcome carries the one-line error.

    Everything is written into a hidden staging folder (``lowp_common.staged_dir``) and moved
    into the output directory only when the whole sweep succeeded; a failed run leaves no
    folder, log or partial file behind (its reason is on the console and in the summary)."""
    from lowp_common import staged_dir

    out_dir = output_dir_for(name, args.output_dir, len(args.input_tensor) > 1)
    outcome = Outcome(path, name, out_dir)
    try:
        check_readable(path)
    except InputError as exc:  # nothing to log about a file that is not there
        outcome.error, outcome.user_error = str(exc), True
        return outcome
    start = time.perf_counter()
    try:
        with staged_dir(out_dir) as stage:
            _sweep_into(stage, idx, path, name, args, stream, outcome)
    except _Discard:
        pass
    except OSError as exc:   # the output directory itself: cannot create or fill it
        outcome.ok, outcome.files = False, {}
        outcome.error = f"{out_dir}: cannot write the output directory ({_reason(exc)})"
    outcome.seconds = time.perf_counter() - start
    return outcome


def _sweep_into(stage: Path, idx: int, path: str, name: str, args: argparse.Namespace, stream,
                outcome: Outcome) -> None:
    """The sweep of one file, its files written into ``stage`` (named by their final paths in
    the log and the outcome); raises _Discard after logging a failure."""
    from quant import scaling_sweep as ss
    from quant_tools import scaling_report as report

    out_dir, fmt = outcome.output_dir, args.elem_format
    final = lambda fname: os.path.join(out_dir, fname)  # noqa: E731
    log_name, results_name = output_files(name, fmt)[:2]
    logger = _make_logger(idx, str(stage / log_name), stream)
    start = time.perf_counter()
    try:
        logger.info(RULE)
        logger.info(f"MXFP scaling test started: {path}")
        logger.info(f"Start time: {time.strftime('%Y-%m-%d %H:%M:%S')}")
        logger.info(f"Output directory: {out_dir}")
        loaded = getattr(args, "loaded", None) or {}
        tensor = loaded.pop(path) if path in loaded else load_input(path)
        dtype = str(getattr(tensor, "dtype", "?")).replace("torch.", "")
        if dtype != "bfloat16" and hasattr(tensor, "is_floating_point") and \
                tensor.is_floating_point():
            logger.info(f"Note: input dtype is {dtype} (bf16 expected); values are analysed "
                        "as float32")
        bar = _progress_bar(tensor, name)
        sweep_start = time.perf_counter()
        try:
            res = ss.run_sweep(tensor, fmt, num_levels=args.num_levels,
                               max_scale_exp=args.max_scale_exp,
                               min_scale_exp=args.min_scale_exp, scale_bits=args.scale_bits,
                               chunk=args.chunk, source=path,
                               progress=None if bar is None else bar.update)
        finally:
            if bar is not None:
                bar.close()
        sweep_s = time.perf_counter() - sweep_start
        for line in report.format_tensor_info(res) + report.format_parameters(res):
            logger.info(line)
        logger.info(f"Tested {len(res.levels)} levels in one batched pass ({sweep_s:.2f} s)")
        for i, lv in enumerate(res.levels):
            logger.info(report.format_level_line(i, lv, len(res.levels)))
        for line in report.format_analysis(res) + report.format_overflow_summary(res):
            logger.info(line)
        atomic_write_text(stage / results_name, report.results_text(res, path))
        files = {"log": final(log_name), "results": final(results_name)}
        logger.info(f"Results saved to: {files['results']}")
        if not args.no_plots:
            files.update(_plots_into(stage, res, name, fmt, final, logger))
        rec = res.recommendation
        if rec is None:
            for line in res.says("recommendation"):
                logger.info(line)
        else:
            logger.info(f"Best result: scale exponent {rec.scale_exp:.2f} (factor "
                        f"{report.fmt_factor(rec.scale_factor)}), composite score "
                        f"{rec.composite_score:.4f}")
        logger.info(f"Log saved to: {files['log']}")
        logger.info(f"Test completed at {time.strftime('%Y-%m-%d %H:%M:%S')} "
                    f"in {time.perf_counter() - start:.2f} s")
        outcome.ok, outcome.result, outcome.files = True, res, files
    except (InputError, ss.SweepInputError) as exc:
        outcome.error, outcome.user_error = str(exc), True
        logger.error(f"❌ {exc}")
        raise _Discard from None
    except (OSError, MemoryError) as exc:
        outcome.error = f"{path}: {type(exc).__name__}: {_reason(exc)}"
        logger.error(f"❌ {outcome.error}")
        raise _Discard from None
    except Exception as exc:  # a bug, not a user mistake: keep going with the other files
        outcome.error = (f"{path}: internal error {type(exc).__name__}: {_reason(exc)} "
                         "(traceback above; please report it)")
        logger.error(f"❌ {outcome.error}\n{traceback.format_exc()}")
        raise _Discard from None
    finally:
        _close_logger(logger)


def _plots_into(stage: Path, res, name: str, fmt: str, final, logger) -> dict[str, str]:
    """The sweep's two figures written into ``stage``; their final paths, logged."""
    from tensor_viz.scaling_plots import plot_summary, plot_sweep

    plot_name, summary_name = output_files(name, fmt)[2:]
    plot_sweep(res, stage / plot_name, name)
    logger.info(f"Plot saved to: {final(plot_name)}")
    plot_summary(res, stage / summary_name, name)
    logger.info(f"Summary plot saved to: {final(summary_name)}")
    return {"plot": final(plot_name), "summary": final(summary_name)}


def _progress_bar(tensor: Any, name: str):
    """A tqdm bar over elements for large tensors (hidden when not on a terminal)."""
    numel = getattr(tensor, "numel", lambda: 0)()
    if numel < (1 << 22):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=numel, desc=f"sweep {name}", unit="el", unit_scale=True, leave=False,
                disable=None)


# --------------------------------------------------------------------------------------
# main


def run(args: argparse.Namespace, stream=None) -> tuple[int, list[Outcome]]:
    """Process every input (one failure never stops the others). Returns (exit code,
    outcomes); exit code 0 only when all succeeded."""
    stream = stream or sys.stdout
    paths = list(args.input_tensor)
    names = tensor_names(paths)
    say = lambda text="": print(text, file=stream, flush=True)  # noqa: E731
    say(f"Processing {len(paths)} tensor(s)...")
    say(RULE)
    outcomes = []
    for i, (path, name) in enumerate(zip(paths, names), start=1):
        say()
        say(f"[{i}/{len(paths)}] Processing: {path}")
        say(DASH)
        oc = process_tensor(i, path, name, args, stream)
        outcomes.append(oc)
        if oc.ok:
            say(f"✅ Successfully processed: {path}")
        else:
            say(f"❌ Failed to process: {path}")
            say(f"   {oc.error}")
    ok = sum(o.ok for o in outcomes)
    say()
    say(RULE)
    say("FINAL SUMMARY")
    say(RULE)
    say(f"Total tensors: {len(outcomes)}")
    say(f"Successful: {ok}")
    say(f"Failed: {len(outcomes) - ok}")
    if ok == len(outcomes):
        say("🎉 All tests completed successfully!")
    else:
        say(f"⚠️  {len(outcomes) - ok} test(s) failed:")
        for o in outcomes:
            if not o.ok:
                say(f"   ❌ {o.error}")
    failed = [o for o in outcomes if not o.ok]
    code = 0 if not failed else EXIT_USER_ERROR if all(o.user_error for o in failed) else 1
    return code, outcomes


def json_document(args: argparse.Namespace, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    ok = sum(o.ok for o in outcomes)
    return {"tool": "mxfp-scaling-test", "format": args.elem_format,
            "num_levels": args.num_levels, "scale_bits": args.scale_bits,
            "total": len(outcomes), "succeeded": ok, "failed": len(outcomes) - ok,
            "tensors": [o.to_dict() for o in outcomes]}


@cli_entry("mxfp-scaling-test")
def main(argv: Sequence[str] | None = None) -> int:
    for s in (sys.stdout, sys.stderr):  # emoji on a console that cannot show them: replace
        try:
            s.reconfigure(errors="replace")
        except (AttributeError, ValueError):
            pass
    parser = build_parser()
    args = parser.parse_args(argv)
    validate_args(args, parser)
    check_inputs_and_outputs(args)
    to_stdout = args.json == "-"
    code, outcomes = run(args, sys.stderr if to_stdout else sys.stdout)
    if args.json is not None:
        text = json_dumps(json_document(args, outcomes), indent=2, ensure_ascii=False)
        if to_stdout:
            print(text)
        else:
            try:
                parent = os.path.dirname(os.path.abspath(args.json))
                os.makedirs(parent, exist_ok=True)
                atomic_write_text(args.json, text + "\n")
            except OSError as exc:
                print(f"mxfp-scaling-test: --json {args.json}: cannot write ({_reason(exc)})",
                      file=sys.stderr)
                return 1
    if code == EXIT_USER_ERROR:
        bad = [o for o in outcomes if not o.ok]
        raise UserError(f"{len(bad)} of {len(outcomes)} files could not be swept; the first: "
                        f"{bad[0].error}")
    return code


if __name__ == "__main__":
    sys.exit(main())
