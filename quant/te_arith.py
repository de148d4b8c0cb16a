"""Transformer Engine's quantizer arithmetic, step by step in float32 (the recipes' kernels).

Why a module of its own: ``quant.formats``' families follow the format definitions (OCP MX,
NVFP4 as published); Transformer Engine's kernels make further choices (the E8M0 exponent of
``amax * fl(1/448)`` rounded up, a global NVFP4 encode scale whose block scales may underflow to
0, multiplication by a rounded reciprocal instead of division, power-of-two masks of FP8 block
scales). ``quant.recipes`` quantizes each GEMM operand through these functions. Facts were read
from TE 2.20 (``common/recipe/recipe_common.cuh``, ``common/cast/mxfp8``, ``common/cast/nvfp4``,
``common/util/ptx*.cuh``, ``pytorch/custom_recipes/reference_nvfp4.py``); docs/quant.md lists
them. Every function takes and returns float32 laid out as ``[rows, k]``: the GEMM reduces
over ``k`` (the last axis), so 1 x n blocks run along it and n x n tiles are square.

Element casts are round-to-nearest-even (or stochastic) with saturation to the largest finite
value (PTX ``cvt.*.satfinite``); a NaN element stays NaN. Amax reductions ignore NaN
(CUDA ``fmaxf``) and keep Inf.
"""
from __future__ import annotations

from typing import Optional

import torch

from .elemwise import ElemParams, finish, pow2_any, round_magnitude_
from .formats import FORMATS

FLT_MAX = float(torch.finfo(torch.float32).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
E4M3_MAX = FORMATS["fp8_e4m3"].max_normal
E2M1_MAX = FORMATS["fp4_e2m1"].max_normal
#: element casts, by format name (the recipes' element formats)
ELEMENTS: dict[str, ElemParams] = {n: ElemParams.of(FORMATS[n])
                                   for n in ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1")}
#: TE's Hadamard sign vector (``get_wgrad_sign_vector`` in custom_recipes/reference_nvfp4.py)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
RHT_SIZE = 16


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def cast(v: torch.Tensor, element: str, rounding: str = "nearest_even",
         noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The saturating cast of float32 ``v`` to ``element`` (``cvt.rn/rs.satfinite``)."""
    p = ELEMENTS[element]
    return finish(round_magnitude_(v.abs(), p, rounding, noise), v, p, True)


def amax_ignoring_nan(x: torch.Tensor, dims=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| as CUDA's fmaxf reduction forms it: NaN ignored, Inf kept (0 for all-NaN)."""
    a = x.abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if dims is None:
        return a.amax() if a.numel() else torch.zeros((), dtype=a.dtype)
    return a.amax(dim=dims, keepdim=keepdim)


def scale_from_amax(amax: torch.Tensor, fp8_max: float, pow2: bool,
                    value_for_inf: float = FLT_MAX) -> torch.Tensor:
    """``compute_scale_from_amax`` (eps 0): fp8_max / amax; 1 for amax 0, Inf or NaN;
    ``value_for_inf`` where the quotient overflows; the power-of-two mask keeps sign and
    exponent bits (rounds the scale down)."""
    scale = _f32(fp8_max) / amax
    scale = scale.masked_fill(torch.isinf(scale), value_for_inf)
    if pow2:
        scale = (scale.view(torch.int32) & ~0x7FFFFF).view(torch.float32)
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    return torch.where(bad, torch.ones_like(scale), scale)


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, element: str, rounding: str = "nearest_even",
                noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """cast(x * scale) * fl(1 / scale): FP8 with float32 scales (per tensor or per block)."""
    q = cast(x * scale, element, rounding, noise)
    return q * torch.reciprocal(scale)


def delayed_scale(history: torch.Tensor, previous: torch.Tensor, fp8_max: float, margin: int,
                  algo: str) -> torch.Tensor:
    """The scale ``amax_and_scale_update`` derives from an amax history ([0] = most recent):
    (fp8_max * 2^-margin) / amax for a finite positive amax, else the previous scale."""
    amax = history[0] if algo == "most_recent" else history.amax()
    scaled_max = _f32(fp8_max * 2.0 ** -margin)
    ok = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(ok, scaled_max / torch.where(ok, amax, torch.ones_like(amax)),
                        previous.to(amax.device))
    return scale.masked_fill(torch.isinf(scale), FLT_MAX)


# ---- MXFP8 ---------------------------------------------------------------------------------------
def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """The biased E8M0 code of non-negative float32 ``v`` rounded toward +Inf, saturating
    (``cvt.rp.satfinite.ue8m0x2.f32``): 0 -> 0, Inf -> 254, NaN -> 255; a subnormal v is 0
    when v <= 2^-127, else 1."""
    bits = v.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    code = torch.where(up, exp + 1, exp)
    code = torch.where(torch.isinf(v), torch.full_like(code, 254), code)
    return torch.where(torch.isnan(v), torch.full_like(code, 255), code)


def mxfp8_blocks(xb: torch.Tensor, element: str = "fp8_e4m3") -> torch.Tensor:
    """TE MXFP8 of float32 ``xb`` shaped [..., 32]: code = e8m0_round_up(amax * fl(1/max)),
    elements cast(x * 2^(127 - code)) times 2^(code - 127)."""
    amax = amax_ignoring_nan(xb, -1, keepdim=True)
    code = e8m0_round_up(amax * _f32(1.0 / ELEMENTS[element].max_normal))
    k = code - 127              # in [-127, 127]: the amax reduction ignores NaN, so no 255
    q = cast(xb * pow2_any(-k), element)
    return q * pow2_any(k)      # exact (448 * 2^127 overflows to Inf, as TE's dequantization)


# ---- FP8 block scaling (1 x 128 and 128 x 128) -------------------------------------------------
def fp8_block_scales(amax: torch.Tensor, element: str, pow2: bool,
                     input_dtype: torch.dtype) -> torch.Tensor:
    """``compute_scale_from_types``: the FP8 block scale; where it overflows, the input type's
    largest value (float32 or bfloat16 max) before the power-of-two mask."""
    inf_value = BF16_MAX if input_dtype == torch.bfloat16 else (
        float(torch.finfo(torch.float16).max) if input_dtype == torch.float16 else FLT_MAX)
    return scale_from_amax(amax, ELEMENTS[element].max_normal, pow2, inf_value)


# ---- NVFP4 ---------------------------------------------------------------------------------------
def nvfp4_global_encode(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448 * 6 / amax, capped at the largest float32; 1 when amax or S_enc is 0."""
    s = (_f32(E4M3_MAX * E2M1_MAX) / amax).clamp(max=FLT_MAX)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def nvfp4_tiles(x: torch.Tensor, tile: tuple[int, int], amax: torch.Tensor,
                rounding: str = "nearest_even",
                noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TE NVFP4 of float32 ``x`` [rows, k] (rows a multiple of tile[0], k of tile[1]) with the
    global amax ``amax`` (of the whole tensor, after any transform).

    s_b = e4m3(tile_amax * (S_enc * fl(1/6))) (0 when it underflows: the tile is flushed),
    elements e2m1(x * min(fl(1 / fl(s_b * S_dec)), FLT_MAX)); the value is q * s_b * S_dec
    with S_dec = fl(1 / S_enc).
    """
    r, c = tile
    rows, k = x.shape
    s_enc = nvfp4_global_encode(amax)
    s_dec = torch.reciprocal(s_enc)
    tiles = x.reshape(rows // r, r, k // c, c)
    t_amax = amax_ignoring_nan(tiles, (1, 3), keepdim=True)
    s_b = cast(t_amax * (s_enc * _f32(1.0 / E2M1_MAX)), "fp8_e4m3")
    enc = torch.reciprocal(s_b * s_dec).clamp(max=FLT_MAX)
    nz = None if noise is None else noise.reshape(tiles.shape)
    q = cast(tiles * enc, "fp4_e2m1", rounding, nz)
    return ((q * s_b) * s_dec).reshape(rows, k)


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
