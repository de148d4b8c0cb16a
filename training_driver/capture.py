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
from typing import Any

PATCHED_DIR_ENV = "MEGATRON_LOWP_PATCHED_DIR"


def capture_requested(env: dict[str, str] | None = None) -> bool:
    """Is capture on? (``tensor_capture.config.env_requests_activity``: the one reading.)"""
    from tensor_capture.config import env_requests_activity

    return env_requests_activity(env)


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
    """Tell megatron's tensor saver which iteration and micro-batch is running.

    A no-op when the patched megatron-core (``megatron.core.tensor_saver``) is not importable.
    """

    def __init__(self) -> None:
        self.saver: Any = None
        try:
            from megatron.core.tensor_saver import get_tensor_saver
        except ImportError:
            return
        self.saver = get_tensor_saver()

    @property
    def active(self) -> bool:
        return self.saver is not None

    def _call(self, name: str, *args: Any) -> None:
        fn = getattr(self.saver, name, None) if self.saver is not None else None
        if fn is not None:
            fn(*args)

    def start_iteration(self, iteration: int) -> None:
        self._call("set_iteration", iteration)

    def start_micro_batch(self, index: int) -> None:
        self._call("set_sample_idx", index)

    def end_iteration(self) -> None:
        self._call("step")

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("flush")
        self._call("close")
