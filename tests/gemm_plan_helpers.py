"""Worker for tests/test_emulation_consistency.py (runs in a spawned process).

It puts the PATCHED megatron-core copy first on sys.path, builds a real ColumnParallelLinear
(bias, TP=1), and runs the same input and output gradient through
(1) the training emulation (CUSTOM_QUANT_TYPE through the patched layers.py and
tensor_saver hooks), (2) precision-diff's emulation (training_profiler.lowp_emulation) on the
same module, (3) precision-diff's emulation on an nn.Linear holding the same weights, and
(4) no emulation. It saves outputs and input / weight / bias gradients of each.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

FORMATS = ("mxfp8", "mxfp4", "nvfp4", "fp8_e4m3")
PATHS = ("training", "diff_megatron", "diff_torch", "off")


def _use_tree(patched_dir: str) -> None:
    sys.path[:] = [p for p in sys.path if not ((Path(p) / "megatron/core/tensor_saver.py").is_file()
                                               and (Path(p) / "megatron/core/__init__.py").is_file())]
    sys.path.insert(0, patched_dir)


def _column_linear():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron.core import ModelParallelConfig

    cfg = ModelParallelConfig(use_cpu_initialization=True)
    torch.manual_seed(11)
    col = ColumnParallelLinear(64, 96, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                               gather_output=False)
    with torch.no_grad():
        col.weight.mul_(0.05)
        col.bias.normal_(0.0, 0.1)
    return col


def _inputs():
    gen = torch.Generator().manual_seed(5)
    # [sequence, batch, hidden]: 64 x 2 = 128 tokens (four 32-blocks along the wgrad axis);
    # columns of differing magnitude so blocking along the wrong axis would show
    x = torch.randn(64, 2, 64, generator=gen) * torch.logspace(-2, 1, 64)
    dy = torch.randn(64, 2, 96, generator=gen) * 1e-2 * torch.logspace(1, -2, 96)
    return x, dy


def _run(module, x, dy, weight, bias):
    for p in (weight, bias):
        if p is not None:
            p.grad = None
    x = x.clone().requires_grad_(True)
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dy)
    return {"out": out.detach().clone(), "dx": x.grad.clone(), "dw": weight.grad.clone(),
            "db": bias.grad.clone()}


def consistency_worker(rank: int, patched_dir: str, port: int, out_dir: str) -> None:
    for var in ("TENSOR_SAVE_ENABLED", "CUSTOM_QUANT_TYPE", "TENSOR_SAVE_CONFIG",
                "TENSOR_SAVER_ITERATION", "TENSOR_SAVE_DIR"):
        os.environ.pop(var, None)
    _use_tree(patched_dir)
    from training_driver import megatron_env as me

    me.init_distributed(0, 1, master_port=port)
    result: dict = {}
    try:
        import megatron.core.tensor_parallel.layers as layers

        from megatron.core import tensor_saver as ts
        from training_profiler.lowp_emulation import emulate_linears

        result["layers_file"] = layers.__file__
        result["patched"] = "tensor_saver" in Path(layers.__file__).read_text()
        col = _column_linear()
        lin = torch.nn.Linear(64, 96)
        with torch.no_grad():
            lin.weight.copy_(col.weight)
            lin.bias.copy_(col.bias)
        x, dy = _inputs()
        ts.reset_tensor_saver()
        result["off"] = _run(col, x, dy, col.weight, col.bias)
        for fmt in FORMATS:
            ts.configure(enabled=False, quant_type=fmt)            # the training emulation
            result[f"training_{fmt}"] = _run(col, x, dy, col.weight, col.bias)
            ts.reset_tensor_saver()
            with emulate_linears(col, fmt) as names:               # precision-diff's
                result[f"diff_megatron_{fmt}_names"] = names
                result[f"diff_megatron_{fmt}"] = _run(col, x, dy, col.weight, col.bias)
            with emulate_linears(lin, fmt):
                result[f"diff_torch_{fmt}"] = _run(lin, x, dy, lin.weight, lin.bias)
        result["restored"] = _run(col, x, dy, col.weight, col.bias)   # patches removed on exit
        result["restored_torch"] = _run(lin, x, dy, lin.weight, lin.bias)
        result["instance_attrs"] = sorted(k for k in ("forward", "_forward_impl")
                                          if k in col.__dict__ or k in lin.__dict__)
    finally:
        torch.save(result, Path(out_dir) / "result_consistency.pt")
        me.destroy_distributed()


def run_consistency(patched_dir: str, out_dir: Path) -> dict:
    import torch.multiprocessing as mp

    from training_driver.megatron_env import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(consistency_worker, args=(patched_dir, free_port(), str(out_dir)), nprocs=1, join=True)
    return torch.load(out_dir / "result_consistency.pt", weights_only=True)
