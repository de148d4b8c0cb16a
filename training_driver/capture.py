"""Tensor capture in the training loop: switch on the patched megatron-core and drive the saver.

The capture engineers' patch set puts capture calls into a copy of megatron-core
(``tensor_capture.patcher.prepare_patched_megatron``); that copy must come first on sys.path
before anything imports megatron. Launchers prepare it once and export
``MEGATRON_LOWP_PATCHED_DIR`` so every rank uses the same copy. When the patch set is not
installed, training runs on the unpatched megatron-core and says so.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

PATCHED_DIR_ENV = "MEGATRON_LOWP_PATCHED_DIR"


def capture_requested(env: dict[str, str] | None = None) -> bool:
    """Is capture on? (``tensor_capture.config.env_requests_activity``: the one reading.)"""
    from tensor_capture.config import env_requests_activity

    return env_requests_activity(env)


def emulation_requested(env: dict[str, str] | None = None) -> bool:
    """Does CUSTOM_QUANT_TYPE name a format to emulate? (The capture config's own reading.)"""
    try:
        from tensor_capture.config import ConfigError, load_config
    except ImportError:
        return False
    try:
        return load_config(env=os.environ if env is None else env).emulating
    except ConfigError:
        return True   # check_capture_config reports the mistake itself


def check_capture_config(env: dict[str, str] | None = None) -> None:
    """Validate TENSOR_SAVE_* / CUSTOM_QUANT_TYPE up front: UserError with the capture's message."""
    from lowp_common.cli import UserError

    try:
        from tensor_capture.config import ConfigError, load_config
    except ImportError:
        return
    try:
        load_config(env=os.environ if env is None else env)
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def _prepend(path: Path) -> None:
    text = str(path)
    if text not in sys.path:
        sys.path.insert(0, text)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if text not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([text] + parts)


def prepare_patched_tree(workdir: str | os.PathLike[str]) -> Path | None:
    """Build the patched megatron-core copy under ``workdir``; None when the patch set is absent."""
    try:
        from tensor_capture.patcher import prepare_patched_megatron
    except ImportError:
        return None
    return Path(prepare_patched_megatron(Path(workdir)))


def activate_patched_megatron(workdir: str | os.PathLike[str]) -> Path | None:
    """Put the patched megatron-core first on sys.path (and PYTHONPATH for child processes).

    Uses ``$MEGATRON_LOWP_PATCHED_DIR`` when a launcher prepared it, else prepares one under
    ``workdir``. Must run before megatron is imported; returns the directory or None.
    """
    if "megatron.core" in sys.modules:
        return Path(os.environ[PATCHED_DIR_ENV]) if os.environ.get(PATCHED_DIR_ENV) else None
    ready = os.environ.get(PATCHED_DIR_ENV)
    path = Path(ready) if ready else prepare_patched_tree(workdir)
    if path is None:
        return None
    _prepend(path)
    os.environ[PATCHED_DIR_ENV] = str(path)
    return path


class SaverHooks:
    """The driver's link to megatron's tensor saver: the same numbering as pretrain_gpt.py.

    Iterations and micro-batch (sample) indexes come from ``tensor_saver.wrap_schedule``, the
    wrapper the patch puts around megatron-core's forward-backward schedules: the pipeline
    path calls megatron's schedule (already wrapped), the single-stage path wraps its own
    micro-batch loop with the same function. The driver only says where a resumed run starts;
    it never steps the saver itself (no double counting). A no-op when the patched
    megatron-core (``megatron.core.tensor_saver``) is not importable.
    """

    def __init__(self) -> None:
        self.module: Any = None
        try:
            from megatron.core import tensor_saver
        except ImportError:
            return
        self.module = tensor_saver

    @property
    def active(self) -> bool:
        return self.module is not None

    def resume_at(self, iteration: int) -> None:
        """The first iteration this process runs (completed iterations of the checkpoint)."""
        if self.module is not None:
            self.module.resume_at(iteration)

    def wrap_schedule(self, schedule: Callable[..., Any]) -> Callable[..., Any]:
        return schedule if self.module is None else self.module.wrap_schedule(schedule)

    def _recorder(self) -> Any:
        if self.module is None:
            return None
        return getattr(self.module.get_tensor_saver(), "recorder", None)

    def recorder_setup(self, cfg: Any, world_size: int, samples_per_iteration: int) -> None:
        """Tell the flight recorder (recorder mode) how to replay this run from its checkpoints."""
        if self._recorder() is None:
            return
        from tensor_capture.recorder import flight as recorder

        from .checkpoint import LATEST_FILE, saved_iterations

        recorder.set_run_info(
            name="llama-train", command=replay_command_builder(cfg, world_size, LATEST_FILE),
            checkpoints=(lambda: saved_iterations(cfg.checkpoint_dir)) if cfg.checkpoint_dir
            else None, checkpoint_dir=cfg.checkpoint_dir,
            samples_per_iteration=samples_per_iteration,
            rng="saved in the checkpoint (torch, python, CUDA), restored on resume")

    def report(self, grad_norm: float) -> None:
        """The iteration's gradient norm, for the recorder's grad_norm_spike trigger."""
        if self._recorder() is not None:
            from tensor_capture.recorder import flight as recorder

            recorder.report(grad_norm=grad_norm)

    def capturing_after(self, iteration: int) -> bool:
        """Whether the recorder's triggered capture still wants iterations after ``iteration``
        (the loop's divergence stop waits for it)."""
        rec = self._recorder()
        return rec is not None and rec.capturing(iteration + 1)

    def close(self) -> None:
        if self.module is not None:
            saver = self.module.get_tensor_saver()
            saver.flush()
            saver.close()


#: llama-train settings a replay sets itself (tensor_capture.recorder.replay): where it resumes
#: from and where it stops, and the outputs of the original run it must not touch
_REPLAY_SET = ("checkpoint_dir", "exit_interval", "save_interval", "resume", "force",
               "stop_file", "progress_file", "tensorboard_dir", "patched_megatron_workdir")


def replay_argv(cfg: Any) -> list[str]:
    """llama-train's options for ``cfg`` (a TrainConfig), as its parser reads them back, less
    those a replay sets itself: the run's exact settings, whether it was started from the
    command line or by ``train()``."""
    from dataclasses import fields

    out: list[str] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in _REPLAY_SET or f.name == "shape" or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                out.append(flag)
            continue
        out += [flag, str(value)]
    return out


def replay_command_builder(cfg: Any, world_size: int, latest_file: str) -> Callable[..., str]:
    """The recorder's replay command for this llama-train run (tensor_capture.recorder.replay.
    RunInfo.command): the checkpoint linked into a fresh folder beside the replay's capture,
    the same settings, full capture by ``env``, a stop after ``last`` (--exit-interval)."""
    import shlex

    base = replay_argv(cfg)
    source = cfg.checkpoint_dir

    def build(checkpoint: int | None, last: int, env: dict[str, str], replay_dir: Path) -> str:
        ckpt = replay_dir / "checkpoints"
        prep = ""
        if checkpoint is not None and source:
            name = f"iter_{checkpoint:07d}"
            prep = (f"mkdir -p {shlex.quote(str(ckpt))} && ln -sfn "
                    f"{shlex.quote(str(Path(source).absolute() / name))} "
                    f"{shlex.quote(str(ckpt / name))} && echo {checkpoint} > "
                    f"{shlex.quote(str(ckpt / latest_file))} && ")
        launch = [sys.executable]
        if world_size > 1:
            launch += ["-m", "training_driver.torchrun", "--standalone", "--nproc-per-node",
                       str(world_size)]
        argv = [*launch, "-m", "training_driver.train", *base, "--checkpoint-dir", str(ckpt),
                "--exit-interval", str(last + 1)]
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        return prep + assigns + " " + " ".join(shlex.quote(a) for a in argv)

    return build
