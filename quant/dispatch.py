"""The fake-quantization core: validation, block layout and table dispatch per scaling family.

``fakequant.quantize`` (the public entry point) adds the optional pre-quantization analysis on
top; ``analysis`` uses this core directly, so neither imports the other in a loop.

Layout for block formats: the block axis is moved last; a length that is not a multiple of the
block size is zero-padded (zeros never change a block's amax, so this equals quantizing the
partial block over its real elements); the padding is cropped off again.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch

from . import accel
from .backends import resolve_backend, triton_kernels
from .elemwise import ElemParams, cast_elements
from .formats import (RANDOM_ROUNDING_MODES, SCALING_IDENTITY, SCALING_MX, SCALING_NONE,
                      SCALING_NVFP4, SCALING_TENSOR, FormatSpec, check_rounding,
                      check_scale_mode, get_format)
from .scaling import (nvfp4_scale_of_amax, quantize_mx_blocks, quantize_mx_inner,
                      quantize_nvfp4_blocks, quantize_nvfp4_inner, quantize_tensor_scaled,
                      tensor_scale_of_amax)

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
    if scale_mode != "floor" and spec.scaling != SCALING_MX:
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


def to_blocks(x: torch.Tensor, axis: int, block: int):
    """Move ``axis`` last and split it into zero-padded blocks: returns (blocks, restore)."""
    if x.dim() == 0:
        x = x.reshape(1)
        axis = 0
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} out of range for a tensor of shape {tuple(x.shape)}")
    axis = axis % x.dim()
    moved = x.movedim(axis, -1)
    moved_shape = moved.shape
    n = moved_shape[-1]
    pad = (-n) % block
    flat = moved.reshape(-1, n)
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.reshape(flat.shape[0], -1, block)

    def restore(yb: torch.Tensor) -> torch.Tensor:
        y = yb.reshape(flat.shape[0], n + pad)
        if pad:
            y = y[:, :n]
        return y.reshape(moved_shape).movedim(-1, axis)

    return blocks, restore


def blocks_in_place(x: torch.Tensor, axis: int, block: int):
    """View x as [outer, nblocks, block, inner] with the blocks along ``axis`` (normalized, not
    the last with inner > 1), without moving it: returns (blocks, restore). No copy when x is
    contiguous and the axis length is a multiple of the block (else one zero-padding copy)."""
    n = x.shape[axis]
    outer = math.prod(x.shape[:axis])
    inner = math.prod(x.shape[axis + 1:])
    v = x.reshape(outer, n, inner)
    pad = (-n) % block
    if pad:
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    blocks = v.reshape(outer, (n + pad) // block, block, inner)

    def restore(yb: torch.Tensor) -> torch.Tensor:
        y = yb.reshape(outer, n + pad, inner)
        if pad:
            y = y[:, :n]
        return y.reshape(x.shape)

    return blocks, restore


def _along_inner(x: torch.Tensor, axis: int, rounding: str) -> Optional[int]:
    """The normalized axis when its blocks are best taken in place (an axis that is not the
    last, deterministic rounding), else None (move the axis last: to_blocks)."""
    if x.dim() < 2 or rounding in RANDOM_ROUNDING_MODES or not -x.dim() <= axis < x.dim():
        return None
    axis %= x.dim()
    return axis if axis < x.dim() - 1 and math.prod(x.shape[axis + 1:]) > 1 else None


def _noise(shape, device, generator, rounding):
    if rounding not in RANDOM_ROUNDING_MODES:
        return None
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)


# ---- one quantizer per scaling family (table-driven dispatch) -------------------------------

def _q_identity(x, spec, p, rounding, saturate, scale_mode, block, axis, generator):
    return x.clone()


def _q_elements(x, spec, p, rounding, saturate, scale_mode, block, axis, generator):
    noise = _noise(x.shape, x.device, generator, rounding)
    return accel.run(cast_elements, x, (p, rounding, saturate), noise)


def _q_tensor(x, spec, p, rounding, saturate, scale_mode, block, axis, generator):
    noise = _noise(x.shape, x.device, generator, rounding)
    return accel.run(quantize_tensor_scaled, x, (p, rounding, saturate), noise)


def _q_mx(x, spec, p, rounding, saturate, scale_mode, block, axis, generator):
    inner_axis = _along_inner(x, axis, rounding)
    if inner_axis is not None:      # weights / wgrad operands: no transposing copies
        xb, restore = blocks_in_place(x, inner_axis, block)
        return restore(accel.run(quantize_mx_inner, xb,
                                 (p, spec.emax, rounding, scale_mode, saturate), keep_dims=2))
    xb, restore = to_blocks(x, axis, block)
    noise = _noise(xb.shape, xb.device, generator, rounding)
    return restore(accel.run(quantize_mx_blocks, xb,
                             (p, spec.emax, rounding, scale_mode, saturate), noise, keep_dims=1))


def _q_nvfp4(x, spec, p, rounding, saturate, scale_mode, block, axis, generator):
    inner_axis = _along_inner(x, axis, rounding)
    if inner_axis is not None:
        xb, restore = blocks_in_place(x, inner_axis, block)
        return restore(accel.run(quantize_nvfp4_inner, xb, (p, rounding, saturate), keep_dims=2))
    xb, restore = to_blocks(x, axis, block)
    noise = _noise(xb.shape, xb.device, generator, rounding)
    return restore(accel.run(quantize_nvfp4_blocks, xb, (p, rounding, saturate), noise,
                             keep_dims=1))


_DISPATCH: dict[str, Callable] = {
    SCALING_IDENTITY: _q_identity,
    SCALING_NONE: _q_elements,
    SCALING_TENSOR: _q_tensor,
    SCALING_MX: _q_mx,
    SCALING_NVFP4: _q_nvfp4,
}


# ---- the same families on the Triton kernels (bit-identical; see quant/triton_kernels.py) ----
# Inputs are made contiguous first. Random rounding draws the torch backend's noise, in its
# layout, from the same generator, then hands it to the kernel in x's layout: the same generator
# state gives the same result on both backends.

def _block_noise(x, axis, block, generator, rounding):
    """Noise drawn exactly as the torch backend draws it for blocks, laid out like x."""
    if rounding not in RANDOM_ROUNDING_MODES:
        return None
    meta_blocks, restore = to_blocks(torch.empty(x.shape, device="meta"), axis, block)
    return restore(_noise(meta_blocks.shape, x.device, generator, rounding)).contiguous()


def _t_elements(x, spec, p, rounding, saturate, scale_mode, block, axis, generator):
    noise = _noise(x.shape, x.device, generator, rounding)
    return triton_kernels().cast_elements(x.contiguous(), p, rounding, saturate, noise)


def _t_tensor(x, spec, p, rounding, saturate, scale_mode, block, axis, generator):
    tk = triton_kernels()
    x = x.contiguous()
    scale = tensor_scale_of_amax(tk.finite_amax(x), p.max_normal)
    noise = _noise(x.shape, x.device, generator, rounding)
    return tk.cast_elements(x, p, rounding, saturate, noise, scale=scale)


def _block_axis(x: torch.Tensor, axis: int) -> int:
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} out of range for a tensor of shape {tuple(x.shape)}")
    return axis % x.dim()


def _t_mx(x, spec, p, rounding, saturate, scale_mode, block, axis, generator):
    x = x.contiguous()
    axis = _block_axis(x, axis)
    noise = _block_noise(x, axis, block, generator, rounding)
    return triton_kernels().quantize_mx(x, axis, block, p, spec.emax, rounding, scale_mode,
                                        saturate, noise)


def _t_nvfp4(x, spec, p, rounding, saturate, scale_mode, block, axis, generator):
    tk = triton_kernels()
    x = x.contiguous()
    axis = _block_axis(x, axis)
    s_t = nvfp4_scale_of_amax(tk.finite_amax(x))
    noise = _block_noise(x, axis, block, generator, rounding)
    return tk.quantize_nvfp4(x, axis, block, p, rounding, saturate, s_t, noise)


_TRITON_DISPATCH: dict[str, Callable] = {
    SCALING_IDENTITY: _q_identity,
    SCALING_NONE: _t_elements,
    SCALING_TENSOR: _t_tensor,
    SCALING_MX: _t_mx,
    SCALING_NVFP4: _t_nvfp4,
}
_TABLES = {"torch": _DISPATCH, "triton": _TRITON_DISPATCH}


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
    table = _TABLES[resolve_backend(backend, x)]
    p = ElemParams.of(spec)
    with torch.no_grad():
        xd = x.detach()
        if xd.numel() == 0:
            return xd.clone()
        # kernels take the input dtype and compute in float32 (the casts fuse when compiled)
        if spec.is_block and xd.dim() == 0:
            y = table[spec.scaling](xd.reshape(1), spec, p, rounding, saturate, scale_mode,
                                    block, 0, generator).reshape(())
        else:
            if not xd.is_contiguous() and not spec.is_block:
                xd = xd.contiguous()
            y = table[spec.scaling](xd, spec, p, rounding, saturate, scale_mode, block, axis,
                                    generator)
        y = y.contiguous()
    return y
