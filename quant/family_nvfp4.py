"""NVFP4 two-level scaling: an E4M3 scale per block of 16 times one float32 scale per tensor
(``nvfp4``), and Transformer Engine's NVFP4 variant.

The format as published: s_t = amax / (6 * 448) over the tensor's finite values (1 for an
all-zero tensor); per block s_b = e4m3(amax_b / 6 / s_t) (nearest even, clamped to
[2^-9, 448]); value = e2m1(x / (s_b * s_t)) * (s_b * s_t); a block holding NaN/Inf is all NaN.
6 and 448 are the largest E2M1 and E4M3 values (quant.formats). TE
(:meth:`NVFP4Family.te_scales`) uses a global encode scale S_enc = 448 * 6 / amax whose block
scales may underflow to 0, and multiplies by a rounded reciprocal instead of dividing.
"""
from __future__ import annotations

import torch

from . import cpu_blocks
from .backends import triton_kernels
from .elemwise import finish, float_exponent, round_magnitude_
from .formats import SCALING_NVFP4, FormatSpec
from .layout import block_axis, block_noise
from .nvfp4_limits import ELEMENT_MAX, SCALE_MAX, SCALE_MIN, SCALE_PARAMS
from .scales import Scales, ScalingFamily, cast_scaled, finite_amax

FLT_MAX = float(torch.finfo(torch.float32).max)


def tensor_scale_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale s_t from the finite amax (shared by both backends)."""
    return torch.where(amax > 0, amax / (ELEMENT_MAX * SCALE_MAX), torch.ones_like(amax))


def block_scale(amax_b: torch.Tensor, s_t: torch.Tensor) -> torch.Tensor:
    """E4M3 block scale: cast(amax_b / 6 / s_t) with nearest-even, clamped to [2^-9, 448]."""
    raw = (amax_b / ELEMENT_MAX) / s_t
    raw = raw.clamp(SCALE_MIN, SCALE_MAX)
    r = round_magnitude_(raw.clone(), SCALE_PARAMS, "nearest_even")
    return finish(r, raw, SCALE_PARAMS, True)


def quantize_blocks(xb, q, nz=None, dim=-1):
    """The torch kernel (compiled by quant.accel) on the whole tensor in blocks, zero padded
    (s_t comes from its finite amax); layouts as quant.family_mx's."""
    s = NVFP4.scales_of_amax(xb.abs().amax(dim=dim, keepdim=True), finite_amax(xb))
    return cast_scaled(xb, s, q, nz)


class NVFP4Family(cpu_blocks.CBlocked, ScalingFamily):
    blocks = staticmethod(quantize_blocks)
    scaling = SCALING_NVFP4
    blocked = True
    uses_tensor_amax = True
    stored_kind = "e4m3_scale"         # the E4M3 block scale value

    def stored_bins(self, stored: torch.Tensor) -> torch.Tensor:
        """One bin per binade floor(log2(scale)) of the E4M3 block scales."""
        return float_exponent(stored)

    @staticmethod
    def scales_of_amax(amax_b: torch.Tensor, tensor_amax: torch.Tensor) -> Scales:
        """Scales from the block amax (NaN/Inf propagate) and the tensor's finite amax.
        A float32-subnormal tensor amax can make s_b * s_t underflow to 0: the values are then
        divided by 1 (the tiny elements round to 0 and 0 * 0 = 0: the block flushes)."""
        s_t = tensor_scale_of_amax(tensor_amax)
        s_b = block_scale(amax_b, s_t)
        denom = s_b * s_t
        return Scales(encode=torch.where(denom > 0, denom, torch.ones_like(denom)),
                      decode=denom, divide=True, poisoned=~torch.isfinite(amax_b), stored=s_b)

    def scales_from(self, amax_b, tensor_amax, spec: FormatSpec, scale_mode: str) -> Scales:
        return self.scales_of_amax(amax_b, tensor_amax)

    def quantize_c(self, lib, x, q):
        """The C kernels (quant.cpu_blocks) on x they take (cpu_blocks.usable): the finite
        amax, s_t from it by the torch definition, then one pass over the blocks."""
        s_t = tensor_scale_of_amax(cpu_blocks.finite_amax(lib, x))
        return cpu_blocks.nvfp4_rows(lib, x, q, float(s_t), SCALE_PARAMS,
                                     (ELEMENT_MAX, SCALE_MIN, SCALE_MAX))

    def quantize_triton(self, x, q, generator=None):
        tk = triton_kernels()
        x = x.contiguous()
        axis = block_axis(x, q.axis)
        s_t = tensor_scale_of_amax(tk.finite_amax(x))
        nz = block_noise(x, axis, q.block, generator, q.rounding)
        return tk.quantize_blocks(x, q.along(axis), tk.NVFP4_RULE, nz, s_t)

    # ---- Transformer Engine's NVFP4 -----------------------------------------------------
    @staticmethod
    def te_global_encode(amax: torch.Tensor) -> torch.Tensor:
        """S_enc = 448 * 6 / amax, capped at the largest float32; 1 when amax or S_enc is 0."""
        s = (torch.tensor(SCALE_MAX * ELEMENT_MAX, dtype=torch.float32) / amax).clamp(
            max=FLT_MAX)
        return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)

    @classmethod
    def te_scales(cls, tile_amax: torch.Tensor, amax: torch.Tensor, scale_cast) -> Scales:
        """TE's scales from NaN-ignoring tile amaxes and the global amax: s_b = e4m3(tile_amax
        * (S_enc * fl(1/6))) (0 when it underflows: the tile flushes), elements encoded by
        min(fl(1 / fl(s_b * S_dec)), FLT_MAX), decoded by s_b, then by S_dec = fl(1 / S_enc).
        ``scale_cast``: the Quantizer of the scale format (nvfp4_limits.SCALE_FORMAT, nearest
        even, saturating), given by the caller: the quantizer dispatches to this family."""
        s_enc = cls.te_global_encode(amax)
        s_dec = torch.reciprocal(s_enc)
        s_b = cast_scaled(tile_amax * (s_enc * torch.tensor(1.0 / ELEMENT_MAX,
                                                            dtype=torch.float32)),
                          Scales(), scale_cast)
        enc = torch.reciprocal(s_b * s_dec).clamp(max=FLT_MAX)
        return Scales(encode=enc, decode=s_b, global_decode=s_dec, stored=s_b)


NVFP4 = NVFP4Family()
