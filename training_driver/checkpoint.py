"""Checkpoints: one file per (tensor, pipeline) rank, written atomically, loaded with weights_only.

Layout::

    CHECKPOINT_DIR/latest_checkpointed_iteration.txt      # the last complete iteration
    CHECKPOINT_DIR/iter_0000010/model_tp00_pp00.pt        # model, optimizer, RNG, config

Only data-parallel rank 0 writes (the other DP replicas hold the same state). The "latest" file
is replaced only after every shard is on disk, so a crash mid-save leaves the previous
checkpoint as the one that resumes.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lowp_common import atomic_path, atomic_write_text
from lowp_common.cli import UserError
from tensor_capture import guard as guard_state

LATEST_FILE = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


def _shard_name(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}_pp{pp_rank:02d}.pt"


def _ranks() -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_data_parallel_rank())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(state["python"]) if not isinstance(state["python"], tuple) else state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def atomic_torch_save(obj: Any, path: Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def save_checkpoint(directory: str | os.PathLike[str], iteration: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, config: dict[str, Any],
                    master: list[torch.Tensor] | None = None) -> Path:
    """Save after ``iteration`` completed iterations; every rank must call it."""
    root = Path(directory)
    it_dir = root / f"iter_{iteration:07d}"
    tp, pp, dp = _ranks()
    if dp == 0:
        it_dir.mkdir(parents=True, exist_ok=True)
        atomic_torch_save({
            "format_version": FORMAT_VERSION, "iteration": iteration,
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": rng_state(), "config": config, "master_params": master or [],
            "guard": guard_state.checkpoint_state(),      # the auto-guard's decisions
        }, it_dir / _shard_name(tp, pp))
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        atomic_write_text(root / LATEST_FILE, f"{iteration}\n")
    _barrier()
    return it_dir


def latest_iteration(directory: str | os.PathLike[str]) -> int | None:
    """The iteration recorded in the latest file, None when there is no checkpoint."""
    latest = Path(directory) / LATEST_FILE
    if not latest.is_file():
        return None
    text = latest.read_text().strip()
    if not text.isdigit():
        raise UserError(f"{latest}: expected an iteration number, found {text[:40]!r}; delete it "
                        "to start from scratch")
    return int(text)


def saved_iterations(directory: str | os.PathLike[str]) -> list[int]:
    """Iterations with a checkpoint folder (``iter_NNNNNNN``) in ``directory``, ascending."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("iter_") and p.name[5:].isdigit())


def load_checkpoint(directory: str | os.PathLike[str], model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, config: dict[str, Any],
                    must_match: tuple[str, ...] = (), master=None) -> int:
    """Resume from the latest checkpoint; returns the iteration to continue from (0 if none).

    ``must_match`` names config keys (model shape, parallel sizes) that must equal the saved
    ones; a mismatch is a UserError rather than a confusing shape error. ``master`` (an
    optim.MasterParams) gets its fp32 copies back for bf16 runs.
    """
    iteration = latest_iteration(directory)
    if iteration is None:
        return 0
    tp, pp, _ = _ranks()
    path = Path(directory) / f"iter_{iteration:07d}" / _shard_name(tp, pp)
    device = next(model.parameters()).device
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: the checkpoint in {directory} was saved with other "
                        "parallel sizes or is incomplete") from None
    except Exception as exc:
        raise UserError(f"{path}: cannot be loaded ({str(exc).splitlines()[0][:200]})") from None
    saved = state.get("config", {})
    for key in must_match:
        if key in saved and saved[key] != config.get(key):
            raise UserError(f"checkpoint {path} has {key}={saved[key]!r} but this run has "
                            f"{key}={config.get(key)!r}: use the same setting or another "
                            "--checkpoint-dir")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if master is not None:
        master.load_state(state.get("master_params") or [])
    set_rng_state(state["rng"])
    _restore_guard(state.get("guard"), int(state["iteration"]))
    return int(state["iteration"])


def _restore_guard(decisions: list[dict[str, Any]] | None, iteration: int) -> None:
    """The auto-guard's decisions saved with the checkpoint hold again in the resumed run."""
    if not decisions:
        return
    from tensor_capture.saver import get_tensor_saver

    guard = get_tensor_saver().guard
    if guard is not None:
        guard.restore(decisions, iteration)
