"""The replay file of a flight-recorder trigger: how to run the fault again, captured in full.

Why: the recorder's ring holds statistics, not tensors; to see the values, and to confirm the
fault is reproducible, the run is resumed from the last checkpoint before the trigger with full
capture over the iterations around it. The file says which checkpoint, the samples consumed,
where the RNG state is, and the exact command, for the training loop that ran (its own builder,
given through :class:`RunInfo`, as ``llama-train`` does) and for Megatron-LM's
``pretrain_gpt.py`` when its arguments are loaded (``megatron.training.global_vars``).

A replay file (``<save_dir>/recorder/replay_it<T>.json``)::

    {"iteration": T, "kinds": [...], "checkpoint": {"iteration": C, "dir": ...} | null,
     "consumed_samples": {"at_checkpoint": ..., "at_trigger": ...}, "rng": "...",
     "capture": {"start": S, "end": E, "dir": <where the replay captures>, "config": <YAML>},
     "env": {variable: value}, "commands": {"llama-train" | "pretrain_gpt": "<shell command>"}}
"""
from __future__ import annotations

import math
import os
import shlex
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from lowp_common import atomic_write_json, atomic_write_text
from quant.vocabulary import ENV_CONFIG, ENV_DIR, ENV_ENABLED, ENV_MODE, ENV_QUANT

from .. import schema
from ..config import MODE_CAPTURE, CaptureConfig
from ..state import STATE

#: Megatron-LM options the replay command sets itself (dropped from the original command line)
_MEGATRON_REPLACED = ("--load", "--save", "--ckpt-step", "--exit-interval", "--save-interval")


@dataclass
class RunInfo:
    """What a training loop tells the recorder about itself (tensor_capture.recorder.flight.
    set_run_info); a STATE session part."""

    name: str | None = None        # the command's name in the replay file ("llama-train")
    #: (checkpoint iteration or None, last iteration to run, env, replay folder) -> shell command
    command: Callable[[int | None, int, dict[str, str], Path], str] | None = None
    checkpoints: Callable[[], list[int]] | None = None   # iterations with a checkpoint
    checkpoint_dir: str | None = None
    samples_per_iteration: int | None = None
    rng: str | None = None         # where the RNG state lives


def _megatron_args() -> Any:
    gv = sys.modules.get("megatron.training.global_vars")
    return getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None


def _iter_dirs(directory: str | None) -> list[int]:
    """Iterations of ``iter_NNNNNNN`` folders (Megatron-LM's and llama-train's layout)."""
    if not directory or not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        if name.startswith("iter_") and name[5:].isdigit():
            out.append(int(name[5:]))
    return sorted(out)


def _config_yaml(config: CaptureConfig, start: int, end: int, save_dir: Path) -> str:
    """The replay's capture config: the run's own selection, full capture of start..end."""
    import yaml

    out: dict[str, Any] = {}
    for f in fields(config):
        v = getattr(config, f.name)
        if f.name.startswith("recorder_") or f.name in ("mode", "iteration", "iter_start",
                                                        "iter_end", "iter_every", "save_dir",
                                                        "max_iterations", "min_iterations"):
            continue
        if v is None or v == f.default:
            continue
        if hasattr(v, "to_dict"):            # the guard's settings (guard_rules.GuardSettings)
            v = v.to_dict()
        out[f.name] = "unlimited" if v == math.inf else (list(v) if isinstance(v, tuple) else v)
    out.update(mode=MODE_CAPTURE, enabled=True, save_dir=str(save_dir),
               max_iterations="unlimited", iterations={"start": start, "end": end})
    return yaml.safe_dump(out, sort_keys=True)


def _megatron_command(args: Any, checkpoint: int | None, end: int, env: dict[str, str],
                      replay_dir: Path) -> str | None:
    """pretrain_gpt.py resumed from ``checkpoint`` of args.save, stopping after ``end``."""
    if args is None or not getattr(args, "save", None):
        return None
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a in _MEGATRON_REPLACED:
            skip = True
            continue
        if a.split("=")[0] in _MEGATRON_REPLACED:
            continue
        argv.append(a)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    launch = (["torchrun", "--nnodes", str(max(1, world // local)), "--nproc-per-node",
               str(local)] if world > 1 else [sys.executable])
    extra = ["--load", str(args.save), "--save", str(replay_dir / "checkpoints"),
             "--exit-interval", str(end + 1)]
    if checkpoint is not None:
        extra += ["--ckpt-step", str(checkpoint)]
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()),
                     *map(shlex.quote, [*launch, sys.argv[0], *argv, *extra])])


def write_replay(out_dir: Path, iteration: int, kinds: list[str], config: CaptureConfig,
                 capture_end: int) -> Path:
    """Write ``replay_it<iteration>.json`` (and the capture YAML it names); its path."""
    info = STATE.session(RunInfo)
    args = _megatron_args()
    ckpt_dir = info.checkpoint_dir or (getattr(args, "save", None) if args is not None else None)
    saved = info.checkpoints() if info.checkpoints is not None else _iter_dirs(ckpt_dir)
    before = [c for c in saved if c <= iteration]
    checkpoint = before[-1] if before else None
    start = max(checkpoint or 0, iteration - config.recorder_window + 1)
    replay_dir = Path(config.save_dir) / f"replay_it{iteration:07d}"
    yaml_path = out_dir / (schema.recorder_replay_name(iteration)[:-len(".json")] + ".yaml")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(yaml_path, _config_yaml(config, start, capture_end, replay_dir / "capture"))
    env = {ENV_ENABLED: "true", ENV_MODE: MODE_CAPTURE, ENV_DIR: str(replay_dir / "capture"),
           ENV_CONFIG: str(yaml_path)}
    if config.quant_type:
        env[ENV_QUANT] = config.quant_type
    per = info.samples_per_iteration or (getattr(args, "global_batch_size", None)
                                         if args is not None else None)
    commands = {}
    if info.command is not None:
        commands[info.name or "training"] = info.command(checkpoint, capture_end, env, replay_dir)
    mega = _megatron_command(args, checkpoint, capture_end, env, replay_dir)
    if mega is not None:
        commands["pretrain_gpt"] = mega
    replay = {
        "iteration": iteration, "kinds": kinds,
        "checkpoint": None if checkpoint is None else {"iteration": checkpoint, "dir": ckpt_dir},
        "consumed_samples": {
            "at_checkpoint": None if per is None or checkpoint is None else checkpoint * per,
            "at_trigger": (getattr(args, "consumed_train_samples", None) if args is not None
                           else None) or (None if per is None else (iteration + 1) * per)},
        "rng": info.rng or ("saved in the checkpoint (Megatron-LM: unless --no-save-rng)"
                            if checkpoint is not None else "from the run's seed"),
        "capture": {"start": start, "end": capture_end, "dir": env[ENV_DIR],
                    "config": str(yaml_path)},
        "env": env, "commands": commands,
    }
    path = out_dir / schema.recorder_replay_name(iteration)
    atomic_write_json(path, replay)
    return path
