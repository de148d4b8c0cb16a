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
    from .errors import UserError

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

    def close(self) -> None:
        if self.module is not None:
            saver = self.module.get_tensor_saver()
            saver.flush()
            saver.close()
