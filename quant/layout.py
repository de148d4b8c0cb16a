"""Block layouts and random-rounding noise shared by every scaling family's quantizers.

Layout for block formats: the block axis is moved last; a length that is not a multiple of the
block size is zero-padded (zeros never change a block's amax, so this equals quantizing the
partial block over its real elements); the padding is cropped off again. Where the axis is not
the last one and rounding is deterministic, blocks are taken in place instead
(:func:`blocks_in_place`: no transposing copy).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .formats import RANDOM_ROUNDING_MODES


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


def along_inner(x: torch.Tensor, axis: int, rounding: str) -> Optional[int]:
    """The normalized axis when its blocks are best taken in place (an axis that is not the
    last, deterministic rounding), else None (move the axis last: to_blocks)."""
    if x.dim() < 2 or rounding in RANDOM_ROUNDING_MODES or not -x.dim() <= axis < x.dim():
        return None
    axis %= x.dim()
    return axis if axis < x.dim() - 1 and math.prod(x.shape[axis + 1:]) > 1 else None


def noise(shape, device, generator, rounding):
    """Uniform [0, 1) float32 noise from the caller's generator for the random rounding modes
    (None for the deterministic ones)."""
    if rounding not in RANDOM_ROUNDING_MODES:
        return None
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)


def block_noise(x, axis, block, generator, rounding):
    """Noise drawn exactly as the torch backend draws it for blocks, laid out like x."""
    if rounding not in RANDOM_ROUNDING_MODES:
        return None
    meta_blocks, restore = to_blocks(torch.empty(x.shape, device="meta"), axis, block)
    return restore(noise(meta_blocks.shape, x.device, generator, rounding)).contiguous()


def block_axis(x: torch.Tensor, axis: int) -> int:
    """``axis`` normalized for x; ValueError naming the shape when it is out of range."""
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} out of range for a tensor of shape {tuple(x.shape)}")
    return axis % x.dim()


def quantize_blocked(x: torch.Tensor, q, inner, gathered, generator=None):
    """The torch path every block-scaled family shares: blocks taken in place along an inner
    axis (weights and wgrad operands, deterministic rounding: no transposing copy) with
    ``inner``, else gathered along the last axis with ``gathered`` and the caller's noise for the
    random roundings. ``q``: the quant.quantizer.Quantizer, the kernels' one constant argument
    (and their cache key)."""
    from . import accel

    static = (q.kernel,)
    inner_axis = along_inner(x, q.axis, q.rounding)
    if inner_axis is not None:
        xb, restore = blocks_in_place(x, inner_axis, q.block)
        return restore(accel.run(inner, xb, static, keep_dims=2))
    xb, restore = to_blocks(x, q.axis, q.block)
    nz = noise(xb.shape, xb.device, generator, q.rounding)
    return restore(accel.run(gathered, xb, static, nz, keep_dims=1))
