"""The fake-quantization core: validation, then the format's scaling family
(quant.families) on the chosen backend.

``fakequant.quantize`` (the public entry point) adds the optional pre-quantization analysis on
top; ``analysis`` uses this core directly, so neither imports the other in a loop. Block
layouts: quant.layout.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .backends import resolve_backend
from .elemwise import ElemParams
from .families import family_of
from .formats import DEFAULT_SCALE_MODE, FormatSpec, check_rounding, check_scale_mode, get_format

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_input(x, where: str = "quantize") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{where}: x has dtype {x.dtype}; supported input dtypes are float32, "
                        "bfloat16 and float16 (convert first, e.g. x.float())")


def resolve_options(spec: FormatSpec, rounding: Optional[str], scale_mode: str,
                    block_size: Optional[int], generator) -> tuple[str, int]:
    """Validate options against the format; return (rounding, block size)."""
    rounding = check_rounding(spec.default_rounding if rounding is None else rounding, spec)
    check_scale_mode(scale_mode)
    if scale_mode != DEFAULT_SCALE_MODE and not family_of(spec).has_scale_modes:
        raise ValueError(f"scale_mode={scale_mode!r} only applies to MX formats (mx*); "
                         f"{spec.name} has scaling {spec.scaling!r}")
    if block_size is not None:
        if not spec.is_block:
            raise ValueError(f"block_size only applies to block formats (mx*, nvfp4); "
                             f"{spec.name} is not one")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return rounding, (block_size or spec.block_size or 0)


def quantize_raw(x: torch.Tensor, fmt: Union[str, FormatSpec], *,
                 block_size: Optional[int] = None, axis: int = -1,
                 rounding: Optional[str] = None, scale_mode: str = "floor",
                 saturate: bool = True,
                 generator: Optional[torch.Generator] = None,
                 backend: str = "auto") -> torch.Tensor:
    """``quantize`` without the analysis hook: the dequantized values (see quantize)."""
    _check_input(x)
    spec = get_format(fmt)
    rounding, block = resolve_options(spec, rounding, scale_mode, block_size, generator)
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"axis must be an int, got {axis!r}")
    family = family_of(spec)
    run = family.quantize_triton if resolve_backend(backend, x) == "triton" else family.quantize
    p = ElemParams.of(spec)
    with torch.no_grad():
        xd = x.detach()
        if xd.numel() == 0:
            return xd.clone()
        # kernels take the input dtype and compute in float32 (the casts fuse when compiled)
        if spec.is_block and xd.dim() == 0:
            y = run(xd.reshape(1), spec, p, rounding, saturate, scale_mode,
                                    block, 0, generator).reshape(())
        else:
            if not xd.is_contiguous() and not spec.is_block:
                xd = xd.contiguous()
            y = run(xd, spec, p, rounding, saturate, scale_mode, block, axis,
                                    generator)
        y = y.contiguous()
    return y
