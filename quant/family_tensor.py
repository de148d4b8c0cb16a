"""Per-tensor scaling: one float32 scale for a whole tensor (``fp8_*_tensor``), and its variants.

The format definition (Transformer Engine current scaling, margin 0): scale = max_normal /
amax over the finite values, 1 when amax is 0 or the quotient is not finite; encoded x * scale,
decoded by fl(1 / scale). The variants are other ways of choosing the same kind of scale:

- TE's ``compute_scale_from_amax`` (:meth:`TensorFamily.te_scale`: NaN-ignoring amax, a
  power-of-two mask, a cap where the quotient overflows), delayed scaling from an amax history
  (:meth:`TensorFamily.delayed_scale`), and TE's FP8 block scaling (the same scale per 1 x 128
  block or 128 x 128 tile: :meth:`TensorFamily.block_scales`); quant.recipes uses them;
- the scale sweep's fixed power-of-two scales, one per level (:meth:`TensorFamily.levels`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import accel
from .backends import triton_kernels
from .formats import SCALING_TENSOR, FormatSpec
from .layout import noise
from .scales import Scales, ScalingFamily, cast_scaled, finite_amax

FLT_MAX = float(torch.finfo(torch.float32).max)
#: the largest value of each input dtype: TE's block scale where max / amax overflows
_DTYPE_MAX = {torch.bfloat16: float(torch.finfo(torch.bfloat16).max),
              torch.float16: float(torch.finfo(torch.float16).max)}


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def scale_of_amax(amax: torch.Tensor, max_normal: float) -> torch.Tensor:
    """The per-tensor scale from the finite amax (shared by both backends)."""
    scale = max_normal / amax
    return torch.where((amax > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))


def _quantize_tensor(x, q, nz=None):
    """The torch kernel of the family (compiled by quant.accel): scales, then the cast."""
    return cast_scaled(x, TENSOR.scales_of_amax(finite_amax(x), q.params.max_normal), q, nz)


class TensorFamily(ScalingFamily):
    scaling = SCALING_TENSOR
    uses_tensor_amax = True

    # ---- the format's own rule ----------------------------------------------------------
    @staticmethod
    def scales_of_amax(amax: torch.Tensor, max_normal: float) -> Scales:
        scale = scale_of_amax(amax, max_normal)
        return Scales(encode=scale, decode=1.0 / scale, stored=scale)

    def scales_from(self, amax_b, tensor_amax, spec: FormatSpec, scale_mode: str) -> Scales:
        return self.scales_of_amax(tensor_amax, spec.max_normal)

    def quantize(self, x, q, generator=None):
        return accel.run(_quantize_tensor, x, (q.kernel,),
                         noise(x.shape, x.device, generator, q.rounding))

    def quantize_triton(self, x, q, generator=None):
        tk = triton_kernels()
        x = x.contiguous()
        scale = scale_of_amax(tk.finite_amax(x), q.params.max_normal)
        nz = noise(x.shape, x.device, generator, q.rounding)
        return tk.cast_elements(x, q, nz, scale=scale)

    # ---- Transformer Engine's variants --------------------------------------------------
    @staticmethod
    def te_scale(amax: torch.Tensor, fp8_max: float, pow2: bool,
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

    @staticmethod
    def te_scales(scale: torch.Tensor) -> Scales:
        """TE's float32 scale (per tensor, or per block broadcast over it): x * scale, decoded
        by the rounded reciprocal fl(1 / scale)."""
        return Scales(encode=scale, decode=torch.reciprocal(scale), stored=scale)

    @classmethod
    def block_scales(cls, amax: torch.Tensor, fp8_max: float, pow2: bool,
                     input_dtype: torch.dtype) -> torch.Tensor:
        """``compute_scale_from_types``: the FP8 block scale; where it overflows, the input
        type's largest value (float32, bfloat16 or float16 max) before the power-of-two mask."""
        return cls.te_scale(amax, fp8_max, pow2, _DTYPE_MAX.get(input_dtype, FLT_MAX))

    @staticmethod
    def delayed_scale(history: torch.Tensor, previous: torch.Tensor, fp8_max: float,
                      margin: int, algo: str) -> torch.Tensor:
        """The scale ``amax_and_scale_update`` derives from an amax history ([0] = most
        recent): (fp8_max * 2^-margin) / amax for a finite positive amax, else the previous."""
        amax = history[0] if algo == "most_recent" else history.amax()
        scaled_max = _f32(fp8_max * 2.0 ** -margin)
        ok = torch.isfinite(amax) & (amax > 0)
        scale = torch.where(ok, scaled_max / torch.where(ok, amax, torch.ones_like(amax)),
                            previous.to(amax.device))
        return scale.masked_fill(torch.isinf(scale), FLT_MAX)

    # ---- the scale sweep's levels -------------------------------------------------------
    @staticmethod
    def level_factors(exponents: Sequence[float]) -> torch.Tensor:
        """float32(2**s) for each exponent s (fractional allowed): the sweep's exact factors."""
        return torch.exp2(torch.tensor(list(exponents), dtype=torch.float64)).to(torch.float32)

    @staticmethod
    def levels(factors: torch.Tensor) -> Scales:
        """One scale per row of a [levels, n] layout: x / f, cast, times f."""
        f = factors.to(torch.float32)[:, None]
        return Scales(encode=f, decode=f, divide=True, stored=f)


TENSOR = TensorFamily()
