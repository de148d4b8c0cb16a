"""What to capture: the selection rules of one TensorSaver, and the books they need.

Why its own module: the rules (iteration schedule, layer / module regex / operation / phase /
tensor-name filters, ranks, byte budget, stats-only, row sampling) change for reasons of
their own and are tested without building a record or touching the disk. The policy keeps
the counters the rules read (iterations saved, bytes written, the record counter) under one
lock; it never builds metadata (tensor_capture.record) and never writes (tensor_capture.sink).
"""
from __future__ import annotations

import logging
import math
import re
import sys
import threading
from typing import Callable

import torch

from . import budget, schema
from .config import CaptureConfig
from .ranks import RankInfo, parallel_ranks

log = logging.getLogger("tensor_capture")



class Warnings:
    """Each warning once per saver (a budget or bad-field message must not flood the log)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def once(self, key: str, message: str) -> None:
        if key not in self._seen:
            self._seen.add(key)
            log.warning(message)
            print(message, file=sys.stderr, flush=True)


class CapturePolicy:
    """Decides whether a tensor is captured and whether its file is kept (see module doc)."""

    def __init__(self, config: CaptureConfig, warn: Callable[[str, str], None]):
        self.config = config
        self._warn = warn
        self.lock = threading.Lock()
        self.counter = 0
        self.bytes = 0
        self.saved_iters: set[int] = set()
        self.budget = budget.ByteBudget(config.byte_budget, config.min_iterations)
        self._ranks: RankInfo | None = None
        self._want_cache: dict[tuple, bool] = {}
        self._regex = re.compile(config.module_regex) if config.module_regex is not None else None

    # -- selection -------------------------------------------------------------------------
    def iteration_selected(self, it: int) -> bool:
        """Whether the schedule (start/end/every, max_iterations) saves this iteration."""
        c = self.config
        if it < c.iter_start or (c.iter_end is not None and it > c.iter_end):
            return False
        if (it - c.iter_start) % c.iter_every:
            return False
        if c.max_iterations is not None and it not in self.saved_iters and (
                len(self.saved_iters) >= c.max_iterations):
            return False
        return True

    def wants(self, layer_type: str, operation: str, phase: str, tensor_name: str,
              layer_idx: int | None = None, module_path: str | None = None) -> bool:
        """Whether the layer/operation/phase/tensor filters select this tensor (cached)."""
        key = (layer_type, operation, phase, tensor_name, layer_idx, module_path)
        hit = self._want_cache.get(key)
        if hit is not None:
            return hit
        c = self.config
        ok = (layer_type in c.layer_types or layer_type not in schema.LAYER_TYPES) and (
            operation in c.operations or operation not in schema.OPERATIONS) and (
            phase in c.phases or phase not in schema.PHASES)
        if ok and c.tensor_names is not None:
            ok = tensor_name in c.tensor_names
        if ok and c.layers is not None:
            ok = layer_idx in c.layers
        if ok and self._regex is not None:
            ok = module_path is not None and self._regex.search(module_path) is not None
        self._want_cache[key] = ok
        return ok

    def rank_selected(self) -> bool:
        if self.config.ranks is None:
            return True
        return self.rank_info()["rank"] in self.config.ranks

    def rank_info(self) -> RankInfo:
        """This process's ranks; cached once torch.distributed (and Megatron's TP) is up."""
        if self._ranks is None or (self._ranks["tp_rank"] is None and
                                   "megatron.core.parallel_state" in sys.modules):
            info = parallel_ranks()
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                self._ranks = info   # stable from now on
            else:
                return info
        return self._ranks

    # -- the file: kept whole, row-sampled, or statistics only -------------------------------
    def sample_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None, int | None]:
        """At most max_rows evenly strided rows of the file (statistics see the whole tensor)."""
        max_rows = self.config.max_rows
        if max_rows is None or x.dim() == 0:
            return x, None, None
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() >= 2 else x.numel()
        if rows <= max_rows:
            return x, None, None
        stride = math.ceil(rows / max_rows)
        flat = x.reshape(rows, -1) if x.dim() >= 2 else x.reshape(rows, 1)
        kept = flat[::stride]
        if x.dim() < 2:
            kept = kept.reshape(-1)
        return kept, kept.shape[0], stride

    def budget_allows(self, nbytes: int, it: int) -> bool:
        return self.budget.allows(self.bytes, nbytes, it, self.saved_iters, self._warn)

    def file_plan(self, x: torch.Tensor, it: int
                  ) -> tuple[bool, torch.Tensor, int | None, int | None, int]:
        """(keep the file?, the rows to keep, sampled rows, row stride, file bytes: 0 if not kept)."""
        if self.config.stats_only:
            return False, x, None, None, 0
        x, sampled_rows, row_stride = self.sample_rows(x)
        nbytes = x.numel() * x.element_size()
        if not self.budget_allows(nbytes, it):
            return False, x, sampled_rows, row_stride, 0
        return True, x, sampled_rows, row_stride, nbytes

    def book(self, it: int, file_bytes: int) -> int:
        """Count one record of iteration ``it`` (``file_bytes`` 0: no file); its counter."""
        with self.lock:
            self.counter += 1
            self.bytes += file_bytes
            self.saved_iters.add(it)
            return self.counter
