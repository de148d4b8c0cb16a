"""A large capture for the report's scale tests: real files written through the saver.

The shape of a user's run that once hung the one-click report: 5 iterations, 16 layers,
3 quant types, about 2,000 files and 1 GiB, each file a bf16 activation or gradient of
512 KiB with its statistics and manifest record, written by TensorSaver.save_tensor.
Values are a few random bases rescaled per file (generation is disk-bound, not randn-bound).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import torch

from tensor_capture.saver import TensorSaver

SEQ, BATCH, HIDDEN, HEADS = 256, 2, 512, 8
#: (layer type, operation, phase, tensor name, component, submodule) of each file per layer
SITES = (
    ("linear", "forward", "pre", "input", "linear", "linear_qkv"),
    ("linear", "forward", "post", "output", "linear", "linear_qkv"),
    ("linear", "backward", "pre", "grad_output", "linear", "linear_qkv"),
    ("linear", "backward", "post", "grad_input", "linear", "linear_qkv"),
    ("linear", "forward", "pre", "input", "linear", "linear_fc2"),
    ("attention", "forward", "pre", "query", "FA", "core_attention"),
    ("attention", "forward", "pre", "key", "FA", "core_attention"),
    ("attention", "forward", "pre", "value", "FA", "core_attention"),
    ("attention", "forward", "post", "context", "FA", "core_attention"),
)
FILE_BYTES = SEQ * BATCH * HIDDEN * 2


def write_big_capture(directory: str | Path, *, quant_types: Sequence[str] = ("hifp8", "mxfp8", "bf16"),
                      iterations: int = 5, layers: int = 16, seed: int = 0) -> int:
    """Write the capture into ``directory``; returns the number of files."""
    gen = torch.Generator().manual_seed(seed)
    bases = [torch.randn(SEQ, BATCH, HIDDEN, generator=gen) for _ in range(4)]
    for b in bases:
        b.view(-1)[:: 4099] *= 30.0                            # a few outliers
    files = 0
    for qt in quant_types:
        saver = TensorSaver(enabled=True, save_dir=str(directory), max_iterations="unlimited",
                            byte_budget="unlimited", range_formats=("fp8_e4m3", "hifp8"))
        try:
            for it in range(iterations):
                saver.set_iteration(it)
                for layer in range(layers):
                    for k, (ltype, op, phase, tname, comp, sub) in enumerate(SITES):
                        scale = (1e-3 if op == "backward" else 1.0) * (1 + 0.2 * layer + 0.1 * it)
                        t = (bases[(k + layer + it) % len(bases)] * scale).to(torch.bfloat16)
                        if ltype == "attention" and tname != "context":
                            t = t.view(SEQ, BATCH, HEADS, HIDDEN // HEADS)
                        owner = "self_attention." + sub if sub != "linear_fc2" else "mlp." + sub
                        path = saver.save_tensor(t, ltype, op, qt, tname, layer, phase=phase,
                                                 component=comp, rank=0, sample_idx=0,
                                                 iteration=it,
                                                 module_path=f"decoder.layers.{layer}.{owner}",
                                                 submodule=sub)
                        assert path, "the saver did not capture the tensor"
                        files += 1
        finally:
            saver.close()
    return files


if __name__ == "__main__":       # python tests/big_capture.py DIR: the capture for a manual run
    print(write_big_capture(sys.argv[1]), "files")
