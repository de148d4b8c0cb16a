"""Transformer Engine's quantizers, step by step in float32 (the recipes' kernels), as variants
of quant's scaling families.

Why variants and not the formats themselves: ``quant.formats``' families follow the format
definitions (OCP MX, NVFP4 as published); Transformer Engine's kernels make further choices (the
E8M0 exponent of ``amax * fl(1/448)`` rounded up, a global NVFP4 encode scale whose block scales
may underflow to 0, multiplication by a rounded reciprocal instead of division, power-of-two masks
of FP8 block scales). Each choice is a scale rule of the family it varies
(``TensorFamily.te_scale`` / ``delayed_scale`` / ``block_scales``, ``MXFamily.te_scales``,
``NVFP4Family.te_scales``); the cast is the families' one cast (quant.scales.cast_scaled).
This module adds what is TE's alone: the NaN-ignoring amax and the 16-point random Hadamard
transform. Facts were read from TE 2.20 (``common/recipe/recipe_common.cuh``,
``common/cast/mxfp8``, ``common/cast/nvfp4``, ``common/util/ptx*.cuh``,
``pytorch/custom_recipes/reference_nvfp4.py``); docs/quant.md lists them. Every function takes
and returns float32 laid out as ``[rows, k]``: the GEMM reduces over ``k`` (the last axis), so
1 x n blocks run along it and n x n tiles are square.

Element casts are round-to-nearest-even (or stochastic) with saturation to the largest finite
value (PTX ``cvt.*.satfinite``); a NaN element stays NaN. Amax reductions ignore NaN
(CUDA ``fmaxf``) and keep Inf.
"""
from __future__ import annotations

from typing import Optional

import torch

from .elemwise import ElemParams
from .family_mx import MX
from .family_mx import e8m0_round_up as e8m0_round_up  # TE's E8M0 rounding, by its old home
from .family_nvfp4 import NVFP4
from .family_tensor import TENSOR
from .formats import FORMATS
from .scales import Scales, cast_scaled

#: element casts, by format name (the recipes' element formats)
ELEMENTS: dict[str, ElemParams] = {n: ElemParams.of(FORMATS[n])
                                   for n in ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1")}
#: TE's Hadamard sign vector (``get_wgrad_sign_vector`` in custom_recipes/reference_nvfp4.py)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
RHT_SIZE = 16
#: TE's scale rules, as the families define them
scale_from_amax = TENSOR.te_scale
delayed_scale = TENSOR.delayed_scale


def cast(v: torch.Tensor, element: str, rounding: str = "nearest_even",
         noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The saturating cast of float32 ``v`` to ``element`` (``cvt.rn/rs.satfinite``)."""
    return cast_scaled(v, Scales(), ELEMENTS[element], rounding, True, noise)


def amax_ignoring_nan(x: torch.Tensor, dims=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| as CUDA's fmaxf reduction forms it: NaN ignored, Inf kept (0 for all-NaN)."""
    a = x.abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if dims is None:
        return a.amax() if a.numel() else torch.zeros((), dtype=a.dtype)
    return a.amax(dim=dims, keepdim=keepdim)


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, element: str, rounding: str = "nearest_even",
                noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """cast(x * scale) * fl(1 / scale): FP8 with float32 scales (per tensor or per block)."""
    return cast_scaled(x, TENSOR.te_scales(scale), ELEMENTS[element], rounding, True, noise)


def mxfp8_blocks(xb: torch.Tensor, element: str = "fp8_e4m3") -> torch.Tensor:
    """TE MXFP8 of float32 ``xb`` shaped [..., 32] (MXFamily.te_scales, then the cast)."""
    p = ELEMENTS[element]
    s = MX.te_scales(amax_ignoring_nan(xb, -1, keepdim=True), p.max_normal)
    return cast_scaled(xb, s, p, "nearest_even", True)


def fp8_block_scales(amax: torch.Tensor, element: str, pow2: bool,
                     input_dtype: torch.dtype) -> torch.Tensor:
    """TE's FP8 block scale of ``element`` (TensorFamily.block_scales)."""
    return TENSOR.block_scales(amax, ELEMENTS[element].max_normal, pow2, input_dtype)


def nvfp4_tiles(x: torch.Tensor, tile: tuple[int, int], amax: torch.Tensor,
                rounding: str = "nearest_even",
                noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TE NVFP4 of float32 ``x`` [rows, k] (rows a multiple of tile[0], k of tile[1]) with the
    global amax ``amax`` (of the whole tensor, after any transform): NVFP4Family.te_scales per
    tile, then the E2M1 cast."""
    r, c = tile
    rows, k = x.shape
    tiles = x.reshape(rows // r, r, k // c, c)
    s = NVFP4.te_scales(amax_ignoring_nan(tiles, (1, 3), keepdim=True), amax)
    nz = None if noise is None else noise.reshape(tiles.shape)
    return cast_scaled(tiles, s, ELEMENTS["fp4_e2m1"], rounding, True, nz).reshape(rows, k)


def hadamard16(device=None) -> torch.Tensor:
    """TE's transform matrix diag(signs) @ H16 / 4 (Sylvester H16, float32; exact entries +-1/4):
    rows of 16 along the reduction axis are multiplied by it (``x @ M``)."""
    h = torch.ones((1, 1), dtype=torch.float32, device=device)
    while h.shape[0] < RHT_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.tensor(RHT_SIGNS, dtype=torch.float32, device=device)[:, None] * h * 0.25


def rht(x: torch.Tensor) -> torch.Tensor:
    """The random Hadamard transform of float32 ``x`` [rows, k] along k in chunks of 16, summed in
    float32 and rounded to bfloat16 as TE's fused kernel does before its amax and cast."""
    rows, k = x.shape
    y = x.reshape(rows, k // RHT_SIZE, RHT_SIZE) @ hadamard16(x.device)
    return y.to(torch.bfloat16).to(torch.float32).reshape(rows, k)


def rht_inverse(y: torch.Tensor) -> torch.Tensor:
    """Back to the original domain (the matrix is orthogonal: its transpose inverts it)."""
    rows, k = y.shape
    return (y.reshape(rows, k // RHT_SIZE, RHT_SIZE) @ hadamard16(y.device).t()).reshape(rows, k)
