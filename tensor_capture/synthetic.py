"""Write a realistic capture directory without Megatron (for plotting and reader tests).

Same file names, metadata, statistics and manifests as a real run, produced through
TensorSaver, with the tensor set one forward+backward of a Llama-style layer captures
(linear_qkv/linear_proj/linear_fc1/linear_fc2 and core_attention; pre/post; forward/backward).
Values are Gaussian with layer- and role-dependent scales, a few outliers, and, for
quantized runs, the operands actually fake-quantized with quant.quantize.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from quant.formats import FORMATS
from quant.vocabulary import LINEAR_OPERANDS

from .saver import TensorSaver
from .schema import CaptureSite

_LINEARS = (("self_attention.linear_qkv", 1.0), ("self_attention.linear_proj", 0.5),
            ("mlp.linear_fc1", 1.0), ("mlp.linear_fc2", 0.3))


def write_synthetic_run(directory: str | Path, *, quant_types: Sequence[str] = ("bf16", "mxfp8"),
                        iterations: Sequence[int] = (0, 1), num_layers: int = 2, ranks: Sequence[int] = (0,),
                        hidden: int = 64, seq: int = 16, batch: int = 2, heads: int = 4,
                        seed: int = 0, stats_only: bool = False) -> Path:
    """Capture files for every (quant type, rank, iteration, layer, tensor); returns ``directory``.

    Each quant type goes to the same directory (its name is in the file names); ranks are
    written as if by separate processes (one manifest per rank).
    """
    out = Path(directory)
    gen = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen) * scale
        t.view(-1)[:: max(1, t.numel() // 3)] *= 20.0          # a few outliers
        return t

    for qt in quant_types:
        emulate = getattr(FORMATS.get(qt), "torch_dtype", None) is None  # bf16/fp16/fp32: plain
        for rank in ranks:
            saver = TensorSaver(enabled=True, save_dir=str(out), stats_only=stats_only,
                                quant_type=qt if emulate else None)
            for it in iterations:
                saver.set_iteration(it)
                for layer in range(num_layers):
                    saver.set_sample_idx(layer % batch)
                    depth = 1.0 + 0.5 * layer + 0.1 * it
                    for sub, scale in _LINEARS:
                        path = f"decoder.layers.{layer}.{sub}"
                        name = sub.rsplit(".", 1)[-1]
                        x = randn(seq, batch, hidden, scale=depth)
                        w = randn(hidden, hidden, scale=0.02 * scale)
                        tensors = (("forward", "pre", "input", x), ("forward", "pre", "weight", w),
                                   ("forward", "post", "output", x @ w.t()),
                                   ("backward", "pre", "grad_output", randn(seq, batch, hidden, scale=1e-3)),
                                   ("backward", "post", "grad_input", randn(seq, batch, hidden, scale=1e-3 * scale)),
                                   ("backward", "post", "grad_weight", randn(hidden, hidden, scale=1e-4)))
                        for op, phase, tname, t in tensors:
                            if emulate and tname in LINEAR_OPERANDS:
                                import quant

                                t = quant.quantize(t, qt)
                            site = CaptureSite(layer_type="linear", operation=op, phase=phase,
                                               tensor_name=tname, component="linear",
                                               layer_idx=layer, module_path=path, submodule=name)
                            saver.capture(t.to(torch.bfloat16), site, rank=rank, iteration=it)
                    path = f"decoder.layers.{layer}.self_attention.core_attention"
                    q = randn(seq, batch, heads, head_dim, scale=depth)
                    for op, phase, tname, t in (
                            ("forward", "pre", "query", q), ("forward", "pre", "key", randn(*q.shape)),
                            ("forward", "pre", "value", randn(*q.shape)),
                            ("forward", "post", "context", randn(seq, batch, hidden, scale=0.5)),
                            ("backward", "pre", "grad_context", randn(seq, batch, hidden, scale=1e-3)),
                            ("backward", "post", "grad_query", randn(*q.shape, scale=1e-4))):
                        site = CaptureSite(layer_type="attention", operation=op, phase=phase,
                                           tensor_name=tname, component="FA", layer_idx=layer,
                                           module_path=path, submodule="core_attention")
                        saver.capture(t.to(torch.bfloat16), site, rank=rank, iteration=it)
            saver.close()
    return out
