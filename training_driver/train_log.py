"""What the training loop tells people and tools: console lines, TensorBoard scalars, a progress file."""
from __future__ import annotations

import json
from typing import Any

from lowp_common import atomic_write_text


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    # Python's NaN token on purpose: the collector reads the loss back as a float to print it.
    atomic_write_text(path, json.dumps(data), make_parents=True)


class TrainLogger:
    """Readable console lines, TensorBoard scalars (when tensorboard is installed), progress file."""

    def __init__(self, log_interval: int, tensorboard_dir: str | None, progress_file: str | None,
                 enabled: bool):
        self.enabled = enabled
        self.log_interval = log_interval
        self.progress_file = progress_file
        self.tb = None
        if enabled and tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("llama-train: tensorboard is not installed; no TensorBoard scalars "
                      "(pip install tensorboard)", flush=True)
            else:
                self.tb = SummaryWriter(log_dir=tensorboard_dir)

    def say(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def iteration(self, it: int, total: int, stats: dict[str, float]) -> None:
        if not self.enabled:
            return
        if (it + 1) % self.log_interval == 0 or it + 1 == total:
            print(f"iter {it + 1:>5}/{total} | loss {stats['loss']:.4f} | grad norm "
                  f"{stats['grad_norm']:.3f} | lr {stats['lr']:.2e} | "
                  f"{stats['tokens_per_s']:,.0f} tokens/s | {stats['seconds']:.2f} s", flush=True)
        if self.tb is not None:
            for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
                self.tb.add_scalar(f"train/{key}", stats[key], it + 1)
        if self.progress_file:
            _write_json_atomic(self.progress_file, {"iteration": it + 1, "train_iters": total, **stats})

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
