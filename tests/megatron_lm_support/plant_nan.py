"""Test support: one NaN in a module's forward input at one iteration, inside a real run (and
``install_scale``: one rank's input to a module scaled, for the outlier-rank diagnosis).

``LOWP_TEST_PLANT_NAN=RANK:MODULE_PATH:ITERATION[:MICRO_BATCH]`` (read by ``sitecustomize.py``
beside this file) puts a NaN into the forward input of the module at MODULE_PATH on global rank
RANK in ITERATION, as the capture numbers iterations (Megatron-LM's own), in micro-batch
MICRO_BATCH (default: the first one the module sees in that iteration). The test
then asks ``lowp-diagnose`` where the first NaN was born.
"""
from __future__ import annotations

import os

import torch

_done: set[int] = set()


def install(spec: str) -> None:
    rank, path, iteration, *micro = spec.split(":")
    if int(os.environ.get("RANK", "0")) != int(rank):
        return
    wanted = int(iteration)
    micro_batch = int(micro[0]) if micro else None

    def pre_hook(module: torch.nn.Module, args: tuple) -> tuple | None:
        from tensor_capture.sites import site_of
        from tensor_capture.state import STATE

        saver = STATE.saver
        if saver is None or wanted in _done or getattr(saver, "iteration", None) != wanted:
            return None
        if micro_batch is not None and getattr(saver, "sample_idx", None) != micro_batch:
            return None
        if site_of(module).module_path != path or not args or not torch.is_tensor(args[0]):
            return None
        _done.add(wanted)
        x = args[0].clone()
        x.view(-1)[7] = float("nan")
        return (x, *args[1:])

    torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)


def install_scale(spec: str) -> None:
    """``LOWP_TEST_PLANT_SCALE=RANK:MODULE_PATH:FROM_ITERATION:FACTOR``: multiply the forward
    input of the module at MODULE_PATH on global rank RANK by FACTOR in every micro-batch from
    FROM_ITERATION on (a bad shard or node: one rank's data out of scale with the others')."""
    rank, path, start, factor = spec.split(":")
    if int(os.environ.get("RANK", "0")) != int(rank):
        return

    def pre_hook(module: torch.nn.Module, args: tuple) -> tuple | None:
        from tensor_capture.sites import site_of
        from tensor_capture.state import STATE

        saver = STATE.saver
        if saver is None or (getattr(saver, "iteration", None) or 0) < int(start):
            return None
        if site_of(module).module_path != path or not args or not torch.is_tensor(args[0]):
            return None
        return (args[0] * float(factor), *args[1:])

    torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
