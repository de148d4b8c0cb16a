"""The tensor collector behind run_wikipedia_tensor_collection.sh.

It sets the TENSOR_SAVE_* variables, launches llama-train, watches the tensor directory with a
progress bar, and stops once at least one full iteration is saved (at least ``--min-files``
tensor files and a finished iteration) or after ``--timeout`` seconds. Then it prints
a summary (files, bytes, by layer type / operation / quant type) and, with ``--visualize``, runs
``script/one_click_visualize.sh``.

With no data given it runs the embedded default: a real-text corpus built from the
documentation Python ships (training_driver.data.corpus), a BPE tokenizer trained on it, a tiny Llama
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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator, Mapping

from lowp_common import CommandParser, HelpWithDefaults, atomic_write_text
from lowp_common.cli import UserError, cli_entry
from quant.vocabulary import ENV_COMPILE, ENV_CONFIG, ENV_DIR, ENV_ENABLED, ENV_ITERATION, ENV_QUANT

from ..tensor_summary import TensorSummary, format_summary, summarize, tensor_files

__all__ = ["TensorSummary", "format_summary", "summarize", "tensor_files"]   # also read here

PROJECT_ROOT = Path(__file__).resolve().parents[2]
VISUALIZE_SCRIPT = PROJECT_ROOT / "script" / "one_click_visualize.sh"
DEFAULT_WORKDIR = Path("runs") / "default"
_T0 = time.monotonic()


def say(message: str, error: bool = False) -> None:
    """A collector line with the seconds since start, so a person sees where time goes."""
    print(f"collector [{time.monotonic() - _T0:5.0f} s]: {message}",
          file=sys.stderr if error else sys.stdout)


# ---------------------------------------------------------------------------------------------
# The embedded default: corpus, tokenizer, indexed dataset
# ---------------------------------------------------------------------------------------------
def prepare_default_data(workdir: str | os.PathLike[str], vocab_size: int = 512,
                         max_chars: int | None = None, rebuild: bool = False) -> dict[str, str]:
    """Build (or reuse) the default corpus, tokenizer and indexed dataset under ``workdir``."""
    from ..data.corpus import write_builtin_corpus
    from ..data.preprocess import DOCUMENT_SUFFIX, META_SUFFIX, preprocess
    from ..data.tokenizer import is_current_tokenizer_dir

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
    p = CommandParser(
        prog="run_wikipedia_tensor_collection.sh",
        description="Collect tensors from a training run: set TENSOR_SAVE_*, launch training, "
                    "watch the tensor directory, stop after one full iteration is saved (or the "
                    "timeout), print a summary, optionally visualize. With no data it runs the "
                    "embedded default (tiny Llama on CPU, corpus built from Python's own "
                    "documentation, nothing downloaded).",
        epilog="Arguments after '--' go to llama-train unchanged.",
        formatter_class=HelpWithDefaults)
    p.add_argument("--data-path", default=None,
                   help="indexed dataset prefix (preprocess-corpus output); default: the "
                        "embedded corpus")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (needed with --data-path)")
    p.add_argument("--tensor-dir", default=os.environ.get(ENV_DIR, "./enhanced_tensor_logs"),
                   help="TENSOR_SAVE_DIR for this run")
    p.add_argument("--quant-type", default=os.environ.get(ENV_QUANT, "hifp8"),
                   help="CUSTOM_QUANT_TYPE: the format emulated in the captured layers")
    p.add_argument("--saver-iteration", default=os.environ.get(ENV_ITERATION),
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
        from ..train import port_free

        if not port_free(int(env_port)):
            raise UserError(f"MASTER_PORT={env_port} is in use: pick a free port or unset "
                            "MASTER_PORT")
        return int(env_port)
    if nproc > 1:
        from ..megatron_env import free_port
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


@dataclass
class CollectRequest:
    """What a collection run is asked for: the command line's options (same names, same
    defaults but for the environment-dependent ones) and the arguments for llama-train."""

    data_path: str | None = None
    tokenizer: str | None = None
    tensor_dir: str = "./enhanced_tensor_logs"
    quant_type: str = "hifp8"
    saver_iteration: str | None = None
    min_files: int = 10
    timeout: float = 300.0
    keep_training: bool = False
    model: str = "tiny"
    train_iters: int = 20
    micro_batch_size: int = 4
    seq_length: int | None = None
    nproc: int = 1
    workdir: str = str(DEFAULT_WORKDIR)
    rebuild_data: bool = False
    default_corpus_chars: int | None = None
    visualize: bool | None = None
    draw_dir: str = "./draw"
    ignore_resource_check: bool = False
    ready_file: str | None = None
    passthrough: tuple[str, ...] = ()


@dataclass
class Collection:
    """A collection run checked and ready to launch: its environment, the training command and
    the files it is watched through."""

    request: CollectRequest
    env: dict[str, str]
    cmd: list[str]
    tensor_dir: Path
    progress_file: Path
    stop_file: Path
    embedded: bool
    visualize: bool


@dataclass
class CollectionResult:
    """How a collection run ended: ``outcome`` is 'collected', 'finished', 'failed', 'timeout'
    or 'interrupted'; ``summary`` counts this run's new tensor files only."""

    outcome: str
    returncode: int | None
    finished_iterations: int | None
    before: set[Path]
    summary: TensorSummary


def request_from_args(args: argparse.Namespace, passthrough: list[str]) -> CollectRequest:
    names = {f.name for f in fields(CollectRequest)} - {"passthrough"}
    return CollectRequest(**{k: v for k, v in vars(args).items() if k in names},
                          passthrough=tuple(passthrough))


def capture_env(req: CollectRequest, base: Mapping[str, str]) -> dict[str, str]:
    """The training environment: ``base`` with capture on into the request's folder and format."""
    env = dict(base)
    env.update({ENV_ENABLED: "true", ENV_DIR: str(Path(req.tensor_dir)), ENV_QUANT: req.quant_type})
    if req.saver_iteration is not None:
        env[ENV_ITERATION] = str(req.saver_iteration)
    # a collection run lasts a few iterations: background kernel compiles would not pay off
    # (and would hold the trainer's exit until done); an explicit QUANT_COMPILE still wins
    env.setdefault(ENV_COMPILE, "0")
    return env


def training_data(req: CollectRequest, env: dict[str, str]) -> dict[str, str]:
    """The dataset and tokenizer to train on: the request's (checked as the launcher checks
    them) or the embedded default, built or reused under the work folder."""
    if req.data_path is None:
        if req.tokenizer:
            raise UserError("--tokenizer without --data-path: give both, or neither for the "
                            "embedded default")
        say("no --data-path given: running the embedded default (tiny Llama on "
            "CPU, corpus built from Python's documentation, nothing downloaded)")
        return prepare_default_data(Path(req.workdir), max_chars=req.default_corpus_chars,
                                    rebuild=req.rebuild_data)
    if not req.tokenizer:
        raise UserError("--data-path needs --tokenizer (the directory preprocess-corpus wrote)")
    from ..preflight import check_inputs

    check_inputs(req.tokenizer, req.data_path, env)   # the launcher's checks, too
    return {"data_path": req.data_path, "tokenizer": req.tokenizer}


def training_args(req: CollectRequest, paths: dict[str, str], progress_file: Path,
                  stop_file: Path) -> list[str]:
    """llama-train's arguments: data, shape, the watch files, then the passthrough."""
    args = ["--data-path", paths["data_path"], "--tokenizer", paths["tokenizer"],
            "--model", req.model, "--train-iters", str(req.train_iters),
            "--micro-batch-size", str(req.micro_batch_size),
            "--progress-file", str(progress_file), "--stop-file", str(stop_file)]
    if req.seq_length:
        args += ["--seq-length", str(req.seq_length)]
    return args + list(req.passthrough)


def _use_patched_tree(env: dict[str, str], workdir: Path) -> None:
    """Put the patched megatron-core copy first on the training's PYTHONPATH (built once)."""
    from ..capture import PATCHED_DIR_ENV, prepare_patched_tree

    if env.get(PATCHED_DIR_ENV):
        return
    patched = prepare_patched_tree(workdir / "patched_megatron")
    if patched is None:
        say("the tensor-capture patch set is not installed; training runs on "
            "unpatched megatron-core and no tensors will be saved")
        return
    env[PATCHED_DIR_ENV] = str(patched)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(patched)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])


def plan_collection(req: CollectRequest, base_env: Mapping[str, str] | None = None) -> Collection:
    """Everything before launch, in order: settings, capture configuration, data, the embedded
    run's capture YAML, the rendezvous port, the resource check, the patched megatron-core.
    UserError on a mistake, before any training process exists."""
    if req.nproc < 1 or req.min_files < 1 or req.timeout <= 0:
        raise UserError("--nproc and --min-files must be at least 1 and --timeout positive")
    if req.ready_file:
        Path(req.ready_file).unlink(missing_ok=True)    # a stale one would mean nothing
    env = capture_env(req, os.environ if base_env is None else base_env)
    from ..capture import check_capture_config

    check_capture_config(env)
    workdir, embedded = Path(req.workdir), req.data_path is None
    paths = training_data(req, env)
    if embedded and not env.get(ENV_CONFIG):
        # One captured iteration is what the default run is for; it keeps the report quick.
        # The quantized operands (the report's "measured" error) and the what-if numerics
        # (numerics.csv, the numerics figures) are what a first look at a format needs.
        capture_yaml = workdir / "capture_default.yaml"
        capture_yaml.write_text(embedded_capture_yaml())
        env[ENV_CONFIG] = str(capture_yaml)
        check_capture_config(env)
    master_port = _check_master_port(req.nproc)
    progress_file = workdir / f"progress_{os.getpid()}.json"
    stop_file = workdir / f"stop_{os.getpid()}"
    train_args = training_args(req, paths, progress_file, stop_file)
    if master_port is not None and req.nproc == 1:
        env["MASTER_PORT"] = str(master_port)
    from ..preflight import CHECKED_ENV
    from ..preflight_cli import check_training_args

    if not req.ignore_resource_check:   # before training starts: memory and capture size
        check_training_args(train_args, req.nproc, env=env, say=say)
    env[CHECKED_ENV] = "1"               # checked (or waived) once, for every rank
    tensor_dir = Path(req.tensor_dir)
    tensor_dir.mkdir(parents=True, exist_ok=True)
    _use_patched_tree(env, workdir)
    cmd = training_command(req.nproc, train_args, master_port if req.nproc > 1 else None)
    return Collection(req, env, cmd, tensor_dir, progress_file, stop_file, embedded,
                      embedded if req.visualize is None else req.visualize)


def run_collection(c: Collection) -> CollectionResult:
    """Launch training, watch it, stop it (cleanly once collected or timed out, at once on
    Ctrl-C), remove the watch files and count this run's tensor files."""
    req = c.request
    before = set(tensor_files(c.tensor_dir))
    say(f"TENSOR_SAVE_DIR={c.tensor_dir} CUSTOM_QUANT_TYPE={req.quant_type} "
        f"TENSOR_SAVER_ITERATION={req.saver_iteration or '<from the run>'}")
    say("launching " + " ".join(c.cmd))
    proc = None
    try:
        with _sigint_held():
            proc = subprocess.Popen(c.cmd, env=c.env, preexec_fn=_ignore_sigint)
        outcome = watch(proc, c.tensor_dir, c.progress_file, before, req.min_files, req.timeout,
                        stop_when_collected=not req.keep_training,
                        ready_file=Path(req.ready_file) if req.ready_file else None)
    except KeyboardInterrupt:
        outcome = "interrupted"
        if proc is None:        # Ctrl-C before training started: nothing to stop
            raise
    if outcome in ("collected", "timeout", "interrupted"):
        _end_training(proc, outcome, c.stop_file, req.timeout)
    finished = _read_progress(c.progress_file).get("iteration")
    for leftover in (c.progress_file, c.stop_file):
        try:
            leftover.unlink()
        except OSError:
            pass
    new = set(tensor_files(c.tensor_dir)) - before
    return CollectionResult(outcome, proc.returncode, finished, before,
                            summarize(c.tensor_dir, only=new))


def _end_training(proc: subprocess.Popen, outcome: str, stop_file: Path, timeout: float) -> None:
    if outcome == "collected":
        say("one full iteration is saved; stopping training")
    elif outcome == "timeout":
        say(f"timeout after {timeout:.0f} s; stopping training")
    try:
        if outcome == "interrupted":
            _interrupt(proc)
        else:
            _stop(proc, stop_file)
    except KeyboardInterrupt:
        proc.kill()
        proc.wait()


def report_collection(c: Collection, result: CollectionResult) -> int:
    """Print the summary and what went wrong if anything; visualize when asked. The exit code."""
    s, tensor_dir = result.summary, c.tensor_dir
    print(format_summary(s, tensor_dir, result.finished_iterations), flush=True)
    if result.outcome == "interrupted":
        say(f"interrupted; the {s.files} tensor files saved so far are intact "
            f"in {tensor_dir}", error=True)
        return 130
    if result.outcome == "failed":
        say(f"training exited with status {result.returncode} (see its message above)", error=True)
        return result.returncode or 1
    if s.files < c.request.min_files:
        say(f"only {s.files} tensor files were saved (wanted {c.request.min_files}); is the "
            "patch set installed and TENSOR_SAVE_ENABLED honored?", error=True)
        return 1
    if result.before:
        say(f"note: {tensor_dir} already held {len(result.before)} tensor files from earlier "
            "runs; the summary counts this run's only"
            + (", the visualization shows all" if c.visualize else ""))
    draw_dir = c.request.draw_dir
    rc = run_visualization(tensor_dir, Path(draw_dir)) if c.visualize else 0
    if rc != 0:
        return rc       # 2: its one line named the mistake (e.g. a report of another capture)
    say(f"done; tensors in {tensor_dir}"
        + (f", plots in {draw_dir}" if c.visualize and VISUALIZE_SCRIPT.is_file() else ""))
    return 0


@cli_entry("run_wikipedia_tensor_collection.sh")
def main(argv: list[str] | None = None) -> int:
    own, passthrough = _split_passthrough(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(own)
    from ..megatron_env import quiet_megatron_warnings

    quiet_megatron_warnings()
    collection = plan_collection(request_from_args(args, passthrough))
    return report_collection(collection, run_collection(collection))


if __name__ == "__main__":
    sys.exit(main())
