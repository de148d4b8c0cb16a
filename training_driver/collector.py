"""The tensor collector behind run_wikipedia_tensor_collection.sh.

It sets the TENSOR_SAVE_* variables, launches llama-train, watches the tensor directory with a
progress bar, and stops once at least one full iteration is saved (at least ``--min-files``
tensor files and a finished iteration; seed item 7) or after ``--timeout`` seconds. Then it prints
a summary (files, bytes, by layer type / operation / quant type) and, with ``--visualize``, runs
``script/one_click_visualize.sh``.

With no data given it runs the embedded default: a real-text corpus built from the
documentation Python ships (training_driver.corpus), a BPE tokenizer trained on it, a tiny Llama
on CPU -- nothing downloaded.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from lowp_common import atomic_write_text, human_bytes

from .errors import UserError, cli_entry

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VISUALIZE_SCRIPT = PROJECT_ROOT / "script" / "one_click_visualize.sh"
DEFAULT_WORKDIR = Path("runs") / "default"
_T0 = time.monotonic()


def say(message: str, error: bool = False) -> None:
    """A collector line with the seconds since start, so a person sees where time goes."""
    print(f"collector [{time.monotonic() - _T0:5.0f} s]: {message}",
          file=sys.stderr if error else sys.stdout)


# ---------------------------------------------------------------------------------------------
# Summary of a tensor directory
# ---------------------------------------------------------------------------------------------
@dataclass
class TensorSummary:
    files: int = 0
    bytes: int = 0
    by_layer_type: Counter = field(default_factory=Counter)
    by_operation: Counter = field(default_factory=Counter)
    by_quant_type: Counter = field(default_factory=Counter)
    iterations: Counter = field(default_factory=Counter)
    unparsed: int = 0


def tensor_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Captured tensor files under ``directory`` (any depth), by name via tensor_capture.schema."""
    from tensor_capture.schema import TENSOR_SUFFIX, is_tensor_filename

    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob(f"*{TENSOR_SUFFIX}")
                  if p.is_file() and is_tensor_filename(p.name))


def summarize(directory: str | os.PathLike[str], only: set[Path] | None = None) -> TensorSummary:
    """Count files, bytes, and files per layer type / operation / quant type / iteration."""
    from tensor_capture.schema import parse_filename

    s = TensorSummary()
    for path in tensor_files(directory):
        if only is not None and path not in only:
            continue
        try:
            name = parse_filename(path.name)
            size = path.stat().st_size
        except (ValueError, OSError):
            s.unparsed += 1
            continue
        s.files += 1
        s.bytes += size
        s.by_layer_type[name.layer_type] += 1
        s.by_operation[name.operation] += 1
        s.by_quant_type[name.quant_type] += 1
        s.iterations["NA" if name.iteration is None else name.iteration] += 1
    return s


def format_summary(s: TensorSummary, directory: str | os.PathLike[str],
                   finished_iterations: int | None = None) -> str:
    """Readable summary; with ``finished_iterations`` (iterations training completed), captured
    iterations at or past it are marked partial (training stopped inside them)."""
    def table(title: str, counts: Counter) -> list[str]:
        lines = [f"  by {title}:"]
        for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0]))):
            lines.append(f"    {str(key):<16} {n:>6}  ({100.0 * n / max(1, s.files):5.1f}%)")
        return lines

    out = [f"tensor summary for {directory}: {s.files} files, {human_bytes(s.bytes)}"]
    if s.files:
        out += table("layer type", s.by_layer_type)
        out += table("operation", s.by_operation)
        out += table("quant type", s.by_quant_type)
        iters = sorted(k for k in s.iterations if k != "NA")
        if iters:
            shown = [f"{i} (partial: training stopped inside it)"
                     if finished_iterations is not None and i >= finished_iterations else str(i)
                     for i in iters[:20]]
            out.append(f"  iterations captured: {len(iters)} (iteration {', '.join(shown)}"
                       + (" ...)" if len(iters) > 20 else ")"))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# The embedded default: corpus, tokenizer, indexed dataset
# ---------------------------------------------------------------------------------------------
def prepare_default_data(workdir: str | os.PathLike[str], vocab_size: int = 512,
                         max_chars: int | None = None, rebuild: bool = False) -> dict[str, str]:
    """Build (or reuse) the default corpus, tokenizer and indexed dataset under ``workdir``."""
    from .corpus import write_builtin_corpus
    from .preprocess import DOCUMENT_SUFFIX, META_SUFFIX, preprocess
    from .tokenizer import is_current_tokenizer_dir

    root = Path(workdir)
    prefix = str(root / "data" / f"python_docs{DOCUMENT_SUFFIX}")
    tokenizer = str(root / "data" / "tokenizer")
    # Data from an older version (our own BPE, no .meta.json) is rebuilt, not reused.
    ready = (all(Path(p).exists() for p in (prefix + ".bin", prefix + ".idx", prefix + META_SUFFIX))
             and is_current_tokenizer_dir(tokenizer))
    if ready and not rebuild:
        say(f"reusing the default corpus in {root / 'data'} (--rebuild-data to redo)")
        return {"data_path": prefix, "tokenizer": tokenizer}
    corpus = root / "corpus" / "python_docs.jsonl"
    info = write_builtin_corpus(corpus, max_chars=max_chars)
    say(f"built the default corpus from Python's own documentation: "
        f"{info['documents']} documents, {info['characters']:,} characters -> {corpus}")
    summary = preprocess([str(corpus)], prefix, tokenizer=None, tokenizer_out=tokenizer,
                         vocab_size=vocab_size, progress=sys.stderr.isatty())
    say(f"trained a {summary['vocab_size']}-token byte-level BPE tokenizer (Hugging Face "
        f"tokenizers) and wrote "
        f"{summary['tokens']:,} tokens to {prefix}.bin/.idx")
    return {"data_path": prefix, "tokenizer": tokenizer}


# ---------------------------------------------------------------------------------------------
# Launch and watch
# ---------------------------------------------------------------------------------------------
def training_command(nproc: int, train_args: list[str], master_port: int | None = None) -> list[str]:
    """One process runs the driver directly; several go through torchrun (training_driver.torchrun:
    torch.distributed.run without its traceback after a rank's own message)."""
    if nproc == 1:
        return [sys.executable, "-m", "training_driver.train", *train_args]
    cmd = [sys.executable, "-m", "training_driver.torchrun", f"--nproc-per-node={nproc}"]
    if master_port is not None:
        cmd.append(f"--master-port={master_port}")
    return [*cmd, "-m", "training_driver.train", *train_args]


def _read_progress(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def full_iteration_saved(new_files: list[Path], progress: dict[str, Any], min_files: int) -> bool:
    """At least ``min_files`` new files and training has finished an iteration that was captured."""
    if len(new_files) < min_files:
        return False
    from tensor_capture.schema import parse_filename

    captured = set()
    for p in new_files:
        try:
            it = parse_filename(p.name).iteration
        except ValueError:
            continue
        if it is not None:
            captured.add(it)
    done = int(progress.get("iteration", 0))  # iterations finished (0-based ids < done)
    if not captured:
        return done >= 1
    return min(captured) < done


def _stop(proc: subprocess.Popen, stop_file: Path, grace: float = 60.0) -> int:
    """End training cleanly: the stop file makes every rank finish its iteration, close the
    saver and exit 0; Ctrl-C-style SIGINT, then SIGTERM, only if it does not."""
    if proc.poll() is None:
        stop_file.parent.mkdir(parents=True, exist_ok=True)
        stop_file.touch()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return proc.returncode


def _ignore_sigint() -> None:
    """In the training child before exec: SIGINT ignored until llama-train's ``cli_entry``
    installs its handler (``lowp_common.honour_ctrl_c``). A Ctrl-C during the interpreter's own
    start would otherwise end it with "Fatal Python error" and a traceback; the collector
    stops it then (``_interrupt``). Unblocked: the parent blocks it around the fork."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold a Ctrl-C back until the block is done. Around ``Popen``: a KeyboardInterrupt inside
    it (after the fork, before it returns) would leave a training process that nobody stops,
    and that was started with SIGINT ignored. The held SIGINT arrives as the block ends, when
    the caller has the process."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _interrupt(proc: subprocess.Popen, settle: float = 3.0) -> int:
    """Ctrl-C: training stops now, not after its iteration. A terminal's Ctrl-C reaches it too
    (same process group) and it flushes its saver; if it still runs after ``settle`` seconds
    (still starting, or the SIGINT went to the collector alone) SIGTERM, which llama-train
    handles like Ctrl-C once training is set up and which ends it silently before; SIGKILL last."""
    steps = ((settle, None), (20.0, signal.SIGTERM), (None, signal.SIGKILL))
    for wait, sig in steps:
        if proc.poll() is not None:
            break
        if sig is not None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.returncode


class _Progress:
    """A tqdm bar on a terminal; otherwise one plain line whenever something changes."""

    def __init__(self, min_files: int):
        self.tty = sys.stdout.isatty()
        self.last = None
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=min_files, desc="tensors saved", unit="file", dynamic_ncols=True)

    def update(self, files: int, min_files: int, progress: dict[str, Any]) -> None:
        it = progress.get("iteration", 0)
        loss = f", loss {progress['loss']:.3f}" if "loss" in progress else ""
        if (files, it) == self.last:
            return
        self.last = (files, it)
        if self.bar is not None:
            self.bar.total = max(min_files, files)
            self.bar.n = files
            self.bar.set_postfix_str(f"iteration {it}{loss}")
        else:
            say(f"{files} tensor files saved, {it} iterations done{loss}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def watch(proc: subprocess.Popen, tensor_dir: Path, progress_file: Path, before: set[Path],
          min_files: int, timeout: float, stop_when_collected: bool,
          poll: float = 0.5, ready_file: Path | None = None) -> str:
    """Wait for training; returns 'collected', 'finished', 'failed' or 'timeout'.

    ``ready_file`` is written once training has finished an iteration and saved tensor files:
    from then on both processes handle Ctrl-C (an event for scripts and tests to wait on)."""
    start = time.monotonic()
    shown = _Progress(min_files)
    try:
        while True:
            new = [p for p in tensor_files(tensor_dir) if p not in before]
            progress = _read_progress(progress_file)
            shown.update(len(new), min_files, progress)
            if ready_file is not None and new and int(progress.get("iteration", 0)) >= 1:
                atomic_write_text(ready_file, f"{os.getpid()} {proc.pid}\n", make_parents=True)
                ready_file = None
            if proc.poll() is not None:
                return "finished" if proc.returncode == 0 else "failed"
            if stop_when_collected and full_iteration_saved(new, progress, min_files):
                return "collected"
            if time.monotonic() - start > timeout:
                return "timeout"
            time.sleep(poll)
    finally:
        shown.close()


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_wikipedia_tensor_collection.sh",
        description="Collect tensors from a training run: set TENSOR_SAVE_*, launch training, "
                    "watch the tensor directory, stop after one full iteration is saved (or the "
                    "timeout), print a summary, optionally visualize. With no data it runs the "
                    "embedded default (tiny Llama on CPU, corpus built from Python's own "
                    "documentation, nothing downloaded).",
        epilog="Arguments after '--' go to llama-train unchanged.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-path", default=None,
                   help="indexed dataset prefix (preprocess-corpus output); default: the "
                        "embedded corpus")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (needed with --data-path)")
    p.add_argument("--tensor-dir", default=os.environ.get("TENSOR_SAVE_DIR", "./enhanced_tensor_logs"),
                   help="TENSOR_SAVE_DIR for this run")
    p.add_argument("--quant-type", default=os.environ.get("CUSTOM_QUANT_TYPE", "hifp8"),
                   help="CUSTOM_QUANT_TYPE: the format emulated in the captured layers")
    p.add_argument("--saver-iteration", default=os.environ.get("TENSOR_SAVER_ITERATION"),
                   help="TENSOR_SAVER_ITERATION: number the first iteration so (default: the "
                        "run's own count, which continues a resumed checkpoint)")
    p.add_argument("--min-files", type=int, default=10,
                   help="tensor files that make a collection complete (with one full iteration)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    p.add_argument("--keep-training", action="store_true",
                   help="let training run to the end instead of stopping once tensors are collected")
    p.add_argument("--model", default="tiny", help="llama-train --model")
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--nproc", type=int, default=1, help="training processes (torchrun when > 1)")
    p.add_argument("--workdir", default=str(DEFAULT_WORKDIR),
                   help="default corpus, patched megatron-core copy, progress file")
    p.add_argument("--rebuild-data", action="store_true", help="rebuild the default corpus")
    p.add_argument("--default-corpus-chars", type=int, default=None,
                   help="cap the default corpus size (characters)")
    vis = p.add_mutually_exclusive_group()
    vis.add_argument("--visualize", dest="visualize", action="store_true", default=None,
                     help="run script/one_click_visualize.sh afterwards (default for the "
                          "embedded run)")
    vis.add_argument("--no-visualize", dest="visualize", action="store_false")
    p.add_argument("--draw-dir", default="./draw", help="visualization output folder")
    p.add_argument("--ignore-resource-check", action="store_true",
                   help="start even when the memory / capture-size estimate says this machine "
                        "cannot hold the run")
    p.add_argument("--ready-file", default=None,
                   help="write this file once training has finished an iteration and saved "
                        "tensors (both processes handle Ctrl-C by then): an event for scripts "
                        "to wait on")
    return p


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _check_master_port(nproc: int) -> int | None:
    env_port = os.environ.get("MASTER_PORT")
    if env_port:
        if not env_port.isdigit():
            raise UserError(f"MASTER_PORT={env_port!r} is not a port number")
        from .train import port_free

        if not port_free(int(env_port)):
            raise UserError(f"MASTER_PORT={env_port} is in use: pick a free port or unset "
                            "MASTER_PORT")
        return int(env_port)
    if nproc > 1:
        from .megatron_env import free_port
        return free_port()
    return None


def run_visualization(tensor_dir: Path, draw_dir: Path) -> int:
    if not VISUALIZE_SCRIPT.is_file():
        say(f"{VISUALIZE_SCRIPT.relative_to(PROJECT_ROOT)} is not available yet; "
            "skipping the visualization")
        return 0
    say(f"visualizing into {draw_dir} ...")
    rc = subprocess.call(["bash", str(VISUALIZE_SCRIPT), str(tensor_dir), str(draw_dir)])
    if rc != 0:
        say(f"the visualization exited with status {rc}", error=True)
    return rc


#: The capture settings of the embedded default run (its TENSOR_SAVE_CONFIG), unless the caller
#: gives its own TENSOR_SAVE_CONFIG.
EMBEDDED_CAPTURE = {"max_iterations": 1, "save_quantized": "true", "whatif_formats": "default"}


def embedded_capture_yaml() -> str:
    """The text of the embedded run's capture YAML."""
    return ("# written by the collector for the embedded default run\n"
            + "".join(f"{k}: {v}\n" for k, v in EMBEDDED_CAPTURE.items()))


@cli_entry("run_wikipedia_tensor_collection.sh")
def main(argv: list[str] | None = None) -> int:
    own, passthrough = _split_passthrough(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(own)
    from .megatron_env import quiet_megatron_warnings

    quiet_megatron_warnings()
    if args.nproc < 1 or args.min_files < 1 or args.timeout <= 0:
        raise UserError("--nproc and --min-files must be at least 1 and --timeout positive")
    tensor_dir = Path(args.tensor_dir)
    if args.ready_file:
        Path(args.ready_file).unlink(missing_ok=True)    # a stale one would mean nothing
    env = dict(os.environ)
    env.update(TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(tensor_dir),
               CUSTOM_QUANT_TYPE=args.quant_type)
    if args.saver_iteration is not None:
        env["TENSOR_SAVER_ITERATION"] = str(args.saver_iteration)
    # a collection run lasts a few iterations: background kernel compiles would not pay off
    # (and would hold the trainer's exit until done); an explicit QUANT_COMPILE still wins
    env.setdefault("QUANT_COMPILE", "0")
    from .capture import PATCHED_DIR_ENV, check_capture_config, prepare_patched_tree

    check_capture_config(env)
    workdir = Path(args.workdir)
    embedded = args.data_path is None
    if embedded:
        if args.tokenizer:
            raise UserError("--tokenizer without --data-path: give both, or neither for the "
                            "embedded default")
        say("no --data-path given: running the embedded default (tiny Llama on "
            "CPU, corpus built from Python's documentation, nothing downloaded)")
        paths = prepare_default_data(workdir, max_chars=args.default_corpus_chars,
                                     rebuild=args.rebuild_data)
    else:
        if not args.tokenizer:
            raise UserError("--data-path needs --tokenizer (the directory preprocess-corpus wrote)")
        from .preflight import check_inputs

        check_inputs(args.tokenizer, args.data_path, env)   # the launcher's checks, too
        paths = {"data_path": args.data_path, "tokenizer": args.tokenizer}
    visualize = embedded if args.visualize is None else args.visualize
    if embedded and not env.get("TENSOR_SAVE_CONFIG"):
        # One captured iteration is what the default run is for; it keeps the report quick.
        # The quantized operands (the report's "measured" error) and the what-if numerics
        # (numerics.csv, the numerics figures) are what a first look at a format needs.
        capture_yaml = workdir / "capture_default.yaml"
        capture_yaml.write_text(embedded_capture_yaml())
        env["TENSOR_SAVE_CONFIG"] = str(capture_yaml)
        check_capture_config(env)
    master_port = _check_master_port(args.nproc)

    progress_file = workdir / f"progress_{os.getpid()}.json"
    stop_file = workdir / f"stop_{os.getpid()}"
    train_args = ["--data-path", paths["data_path"], "--tokenizer", paths["tokenizer"],
                  "--model", args.model, "--train-iters", str(args.train_iters),
                  "--micro-batch-size", str(args.micro_batch_size),
                  "--progress-file", str(progress_file), "--stop-file", str(stop_file)]
    if args.seq_length:
        train_args += ["--seq-length", str(args.seq_length)]
    train_args += passthrough
    if master_port is not None and args.nproc == 1:
        env["MASTER_PORT"] = str(master_port)
    from .preflight import CHECKED_ENV
    from .preflight_cli import check_training_args

    if not args.ignore_resource_check:   # before training starts: memory and capture size
        check_training_args(train_args, args.nproc, env=env, say=say)
    env[CHECKED_ENV] = "1"               # checked (or waived) once, for every rank
    tensor_dir.mkdir(parents=True, exist_ok=True)
    if not env.get(PATCHED_DIR_ENV):
        patched = prepare_patched_tree(workdir / "patched_megatron")
        if patched is None:
            say("the tensor-capture patch set is not installed; training runs on "
                "unpatched megatron-core and no tensors will be saved")
        else:
            env[PATCHED_DIR_ENV] = str(patched)
            env["PYTHONPATH"] = os.pathsep.join(
                [str(patched)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = training_command(args.nproc, train_args, master_port if args.nproc > 1 else None)
    before = set(tensor_files(tensor_dir))
    say(f"TENSOR_SAVE_DIR={tensor_dir} CUSTOM_QUANT_TYPE={args.quant_type} "
        f"TENSOR_SAVER_ITERATION={args.saver_iteration or '<from the run>'}")
    say("launching " + " ".join(cmd))
    proc = None
    interrupted = False
    try:
        with _sigint_held():
            proc = subprocess.Popen(cmd, env=env, preexec_fn=_ignore_sigint)
        outcome = watch(proc, tensor_dir, progress_file, before, args.min_files, args.timeout,
                        stop_when_collected=not args.keep_training,
                        ready_file=Path(args.ready_file) if args.ready_file else None)
    except KeyboardInterrupt:
        interrupted = True
        outcome = "interrupted"
        if proc is None:        # Ctrl-C before training started: nothing to stop
            raise
    if outcome in ("collected", "timeout", "interrupted"):
        if outcome == "collected":
            say("one full iteration is saved; stopping training")
        elif outcome == "timeout":
            say(f"timeout after {args.timeout:.0f} s; stopping training")
        try:
            if outcome == "interrupted":
                _interrupt(proc)
            else:
                _stop(proc, stop_file)
        except KeyboardInterrupt:
            proc.kill()
            proc.wait()
    rc = proc.returncode
    finished = _read_progress(progress_file).get("iteration")
    for leftover in (progress_file, stop_file):
        try:
            leftover.unlink()
        except OSError:
            pass
    new = set(tensor_files(tensor_dir)) - before
    summary = summarize(tensor_dir, only=new)
    print(format_summary(summary, tensor_dir, finished), flush=True)
    if interrupted:
        say(f"interrupted; the {summary.files} tensor files saved so far are intact "
            f"in {tensor_dir}", error=True)
        return 130
    if outcome == "failed":
        say(f"training exited with status {rc} (see its message above)", error=True)
        return rc or 1
    if summary.files < args.min_files:
        say(f"only {summary.files} tensor files were saved (wanted "
            f"{args.min_files}); is the patch set installed and TENSOR_SAVE_ENABLED honored?", error=True)
        return 1
    if before:
        say(f"note: {tensor_dir} already held {len(before)} tensor files from earlier runs; the "
            "summary counts this run's only" + (", the visualization shows all" if visualize else ""))
    if visualize:
        if run_visualization(tensor_dir, Path(args.draw_dir)) != 0:
            return 1
    say(f"done; tensors in {tensor_dir}"
        + (f", plots in {args.draw_dir}" if visualize and VISUALIZE_SCRIPT.is_file() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
