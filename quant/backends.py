"""Which kernels run a quantization: the torch backend (eager / torch.compile) or Triton.

``auto`` takes Triton for CUDA tensors when Triton imports, torch otherwise. The Triton kernels
also run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before ``quant``
loads them; slow, for tests). Both backends give bit-identical results (tests/test_quant_triton.py).
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from .interpreter import triton_interpreting
from .optional import OptionalModule

BACKENDS = ("auto", "torch", "triton")


def _load_triton_kernels() -> ModuleType:
    from . import triton_kernels

    return triton_kernels


#: the Triton kernels, imported on first use; this process's one record of whether Triton
#: imports (``TRITON_KERNELS.reset()`` makes the next use try again)
TRITON_KERNELS = OptionalModule(_load_triton_kernels)


def triton_kernels() -> Optional[ModuleType]:
    """``quant.triton_kernels`` or None when Triton is not installed (imported once)."""
    return TRITON_KERNELS.get()


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """'torch' or 'triton' for tensor x; a clear error for a backend that cannot run it."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown quantization backend {backend!r}; valid backends: "
                         f"{', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if x.is_cuda and triton_kernels() is not None else "torch"
    if triton_kernels() is None:
        raise RuntimeError("backend='triton' needs the triton package, which is not importable "
                           f"({TRITON_KERNELS.error}); install it with `pip install triton` (CUDA "
                           "builds of torch bring it) or use backend='torch'")
    if not x.is_cuda and not triton_interpreting():
        raise ValueError(f"backend='triton' runs on CUDA tensors; x is on {x.device}. Move x "
                         "to the GPU, use backend='torch', or set TRITON_INTERPRET=1 before "
                         "importing quant to run the kernels in Triton's CPU interpreter")
    return "triton"
