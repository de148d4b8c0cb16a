"""Scale selection: MX shared exponents (E8M0), NVFP4 two-level scales, per-tensor amax scales.

Every function here works on float32 tensors already laid out as [..., block] (block formats) or
on a whole tensor (per-tensor scaling), and returns the fake-quantized float32 values.
"""
from __future__ import annotations

from typing import Optional

import torch

from .elemwise import ElemParams, finish, float_exponent, pow2_any, round_magnitude_
from .formats import E8M0_MAX_EXP, E8M0_MIN_EXP

E4M3_PARAMS = ElemParams(grid_emin=-6, grid_emax=9, mbits=3, tapered=False, max_normal=448.0,
                         overflow="nan", signed_zero=True)
E4M3_MIN_SUBNORMAL = 2.0 ** -9
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """ceil(log2(a)) for non-negative float32 a, exact, from the bits (-127 for zero/subnormal)."""
    bits = a.view(torch.int32)
    e = (bits >> 23) - 127
    frac = (bits & 0x7FFFFF) != 0
    return torch.where(e == -127, e, e + frac.to(torch.int32))


def mx_shared_exponent(amax: torch.Tensor, emax_elem: int, max_normal: float,
                       scale_mode: str) -> torch.Tensor:
    """E8M0 exponent per block (int32), clamped to [-127, 127].

    floor: floor(log2(amax)) - emax_elem (OCP v1.0); ceil: ceil(log2(amax)) - emax_elem;
    rceil: the smallest s with amax <= max_normal * 2^s (never saturates while in range).
    """
    if scale_mode == "floor":
        s = float_exponent(amax) - emax_elem
    elif scale_mode == "ceil":
        s = ceil_log2(amax) - emax_elem
    elif scale_mode == "rceil":
        s = ceil_log2(amax / max_normal)
        # the float division may round down across a power of two: fix with an exact check
        bound = max_normal * pow2_any(s.clamp(-149, 127))
        s = torch.where(amax > bound, s + 1, s)
    else:
        raise ValueError(f"unknown MX scale mode {scale_mode!r}")
    return s.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def quantize_mx_blocks(xb: torch.Tensor, p: ElemParams, emax_elem: int, rounding: str,
                       scale_mode: str, saturate: bool,
                       noise: Optional[torch.Tensor] = None, dim: int = -1) -> torch.Tensor:
    """MX fake quantization of float32 xb shaped [..., nblocks, block] (``dim`` = -1) or
    [..., nblocks, block, inner] (``dim`` = -2: blocks along a dimension that is not the last,
    without moving it).

    A block whose amax is NaN or Inf (any NaN/Inf inside) becomes all NaN: its E8M0 scale would
    be the NaN code 0xFF.
    """
    amax = xb.abs().amax(dim=dim, keepdim=True)
    s = mx_shared_exponent(amax, emax_elem, p.max_normal, scale_mode)
    v = xb * pow2_any(-s)
    y = finish(round_magnitude_(v.abs(), p, rounding, noise), v, p, saturate).mul_(pow2_any(s))
    return y.masked_fill_(~torch.isfinite(amax), float("nan"))


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite values (0 when there are none), as a 0-dim float32 tensor.

    Branch-free (one fused pass when compiled): Inf/NaN are replaced by 0 before the max.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    a = x.abs()
    return torch.where(a < float("inf"), a, torch.zeros_like(a)).amax()


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """FP32 per-tensor scale amax / (6 * 448) over finite values; 1 for an all-zero tensor."""
    return nvfp4_scale_of_amax(finite_amax(x))


def nvfp4_scale_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """The NVFP4 per-tensor scale from the finite amax (shared by both backends)."""
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def nvfp4_block_scale(amax_b: torch.Tensor, s_t: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale: cast(amax_b / 6 / s_t) with nearest-even, clamped to [2^-9, 448]."""
    raw = (amax_b / E2M1_MAX) / s_t
    raw = raw.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)
    r = round_magnitude_(raw.clone(), E4M3_PARAMS, "nearest_even")
    return finish(r, raw, E4M3_PARAMS, True)


def quantize_nvfp4_blocks(xb: torch.Tensor, p: ElemParams, rounding: str, saturate: bool,
                          noise: Optional[torch.Tensor] = None, dim: int = -1) -> torch.Tensor:
    """NVFP4 fake quantization of float32 xb shaped [..., nblocks, 16] (the whole tensor, zero
    padded: the per-tensor scale s_t comes from its finite amax); ``dim`` as in
    quantize_mx_blocks.

    value = e2m1(x / (s_b * s_t)) * (s_b * s_t); a block holding NaN/Inf becomes all NaN.
    """
    s_t = nvfp4_tensor_scale(xb)
    amax = xb.abs().amax(dim=dim, keepdim=True)
    s_b = nvfp4_block_scale(amax, s_t)
    denom = s_b * s_t
    # a float32-subnormal tensor amax can make denom underflow to 0: divide by 1 instead (the
    # tiny elements then round to 0, and 0 * denom = 0: the block flushes)
    v = xb / torch.where(denom > 0, denom, torch.ones_like(denom))
    y = finish(round_magnitude_(v.abs(), p, rounding, noise), v, p, saturate).mul_(denom)
    return y.masked_fill_(~torch.isfinite(amax), float("nan"))


def tensor_scale(x: torch.Tensor, max_normal: float) -> torch.Tensor:
    """Per-tensor scale max_normal / amax (finite values); 1 when amax is 0 or the scale is not
    finite (Transformer Engine current scaling, margin 0)."""
    return tensor_scale_of_amax(finite_amax(x), max_normal)


def tensor_scale_of_amax(amax: torch.Tensor, max_normal: float) -> torch.Tensor:
    """The per-tensor scale from the finite amax (shared by both backends)."""
    scale = max_normal / amax
    return torch.where((amax > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))


def quantize_tensor_scaled(x: torch.Tensor, p: ElemParams, rounding: str, saturate: bool,
                           noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """cast(x * scale) * (1 / scale): FP8 with one FP32 scale per tensor (from x's amax)."""
    scale = tensor_scale(x, p.max_normal)
    v = x * scale
    return finish(round_magnitude_(v.abs(), p, rounding, noise), v, p, saturate).mul_(1.0 / scale)


def quantize_mx_inner(xb: torch.Tensor, p: ElemParams, emax_elem: int, rounding: str,
                      scale_mode: str, saturate: bool) -> torch.Tensor:
    """quantize_mx_blocks on [..., nblocks, block, inner] (deterministic rounding)."""
    return quantize_mx_blocks(xb, p, emax_elem, rounding, scale_mode, saturate, None, dim=-2)


def quantize_nvfp4_inner(xb: torch.Tensor, p: ElemParams, rounding: str,
                         saturate: bool) -> torch.Tensor:
    """quantize_nvfp4_blocks on [..., nblocks, block, inner] (deterministic rounding)."""
    return quantize_nvfp4_blocks(xb, p, rounding, saturate, None, dim=-2)
