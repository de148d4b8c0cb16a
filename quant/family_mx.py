"""OCP MX block scaling: one E8M0 power-of-two scale per block (``mx*`` formats), and TE's
MXFP8 variant.

The shared exponent s of a block (int32, clamped to E8M0's [-127, 127]) comes from the block's
amax by the scale mode: floor: floor(log2 amax) - emax_elem (OCP v1.0); ceil: ceil(log2 amax) -
emax_elem; rceil: the smallest s with amax <= max_normal * 2^s (never saturates while in range);
encoded x * 2^-s, decoded by 2^s; a block whose amax is NaN or Inf becomes all NaN (its E8M0
code would be the NaN code 0xFF). Transformer Engine's MXFP8 (:meth:`MXFamily.te_scales`)
rounds the exponent of amax * fl(1 / max_normal) up instead and ignores NaN in the amax.
"""
from __future__ import annotations

import torch

from . import cpu_blocks
from .backends import triton_kernels
from .elemwise import float_exponent, pow2_any
from .formats import E8M0_MAX_EXP, E8M0_MIN_EXP, SCALING_MX, FormatSpec
from .layout import block_axis, block_noise
from .scales import Scales, ScalingFamily, cast_scaled


def ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """ceil(log2(a)) for non-negative float32 a, exact, from the bits (-127 for zero/subnormal)."""
    bits = a.view(torch.int32)
    e = (bits >> 23) - 127
    frac = (bits & 0x7FFFFF) != 0
    return torch.where(e == -127, e, e + frac.to(torch.int32))


def shared_exponent(amax: torch.Tensor, emax_elem: int, max_normal: float,
                    scale_mode: str) -> torch.Tensor:
    """The E8M0 exponent per block (int32) by ``scale_mode`` (module docstring)."""
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


def quantize_blocks(xb, q, nz=None, dim=-1):
    """The torch kernel (compiled by quant.accel) on [..., nblocks, block] (dim -1) or
    [..., nblocks, block, inner] (dim -2), as quantizer ``q`` configures it."""
    amax = xb.abs().amax(dim=dim, keepdim=True)
    s = MX.scales_of_amax(amax, q.spec.emax, q.params.max_normal, q.scale_mode)
    return cast_scaled(xb, s, q, nz)


class MXFamily(cpu_blocks.CBlocked, ScalingFamily):
    blocks = staticmethod(quantize_blocks)
    scaling = SCALING_MX
    blocked = True
    has_scale_modes = True
    stored_kind = "e8m0_exponent"      # the shared exponent s itself; bins: one per exponent

    @staticmethod
    def scales_of_amax(amax: torch.Tensor, emax_elem: int, max_normal: float,
                       scale_mode: str) -> Scales:
        """Scales from the block amax (NaN/Inf propagate: such blocks are poisoned)."""
        s = shared_exponent(amax, emax_elem, max_normal, scale_mode)
        return Scales(encode=pow2_any(-s), decode=pow2_any(s), poisoned=~torch.isfinite(amax),
                      stored=s)

    def scales_from(self, amax_b, tensor_amax, spec: FormatSpec, scale_mode: str) -> Scales:
        return self.scales_of_amax(amax_b, spec.emax, spec.max_normal, scale_mode)

    def quantize_c(self, lib, x, q):
        """The one-pass C kernel (quant.cpu_blocks) on x it takes (cpu_blocks.usable)."""
        return cpu_blocks.mx_rows(lib, x, q, cpu_blocks.SCALE_MODE_CODES[q.scale_mode])

    def quantize_triton(self, x, q, generator=None):
        tk = triton_kernels()
        x = x.contiguous()
        axis = block_axis(x, q.axis)
        nz = block_noise(x, axis, q.block, generator, q.rounding)
        return tk.quantize_blocks(x, q.along(axis), tk.MX_RULE, nz)

    # ---- Transformer Engine's MXFP8 -----------------------------------------------------
    @staticmethod
    def te_scales(amax: torch.Tensor, max_normal: float) -> Scales:
        """TE's rule from a NaN-ignoring block amax: code = e8m0_round_up(amax *
        fl(1 / max_normal)), k = code - 127 in [-127, 127]; x * 2^-k, decoded by 2^k (exact:
        max_normal * 2^127 overflows to Inf, as TE's dequantization does). No block is
        poisoned: the amax ignores NaN, an Inf amax gives k = 127."""
        code = e8m0_round_up(amax * torch.tensor(1.0 / max_normal, dtype=torch.float32))
        k = code - 127
        return Scales(encode=pow2_any(-k), decode=pow2_any(k), stored=k)


MX = MXFamily()
