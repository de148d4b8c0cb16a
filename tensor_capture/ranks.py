"""Which process this is: global rank, world size and Megatron's TP / PP / DP ranks.

One reading for the records' metadata (tensor_capture.policy) and for the lines printed once
per job (tensor_capture.budget); Megatron is never imported, only read when already loaded.
"""
from __future__ import annotations

import os
import sys

import torch

RankInfo = dict[str, "int | None"]


def parallel_ranks() -> RankInfo:
    """Global/TP/PP/DP ranks and world size, without importing Megatron if it is not loaded."""
    out: RankInfo = {"rank": 0, "tp_rank": None, "pp_rank": None, "dp_rank": None,
                     "world_size": 1}
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        out["rank"] = dist.get_rank()
        out["world_size"] = dist.get_world_size()
    else:
        out["rank"] = int(os.environ.get("RANK", 0) or 0)
        out["world_size"] = int(os.environ.get("WORLD_SIZE", 1) or 1)
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        try:
            if ps.model_parallel_is_initialized():
                out["tp_rank"] = ps.get_tensor_model_parallel_rank()
                out["pp_rank"] = ps.get_pipeline_model_parallel_rank()
                out["dp_rank"] = ps.get_data_parallel_rank()
        except Exception:  # partially initialized state: leave them unknown
            pass
    return out


def global_rank() -> int:
    """This process's global rank (torch.distributed when initialized, else $RANK, else 0)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0
