"""``Scales``, what a scaling family chose for one tensor, and ``ScalingFamily``, the interface
every family implements (one file per family: quant/family_*.py; the table: quant/families.py).

Why one object: a scaled format is "choose scales, then cast the scaled elements". The
quantizer, the pre-quantization analysis, the what-if numbers, the scale sweep and the recipes
all need the scales, so a family computes them once (:meth:`ScalingFamily.scales`) and everything
reads them from the returned :class:`Scales`; the element cast (:func:`cast_scaled`) is the one
of :mod:`quant.elemwise`.

Every tensor here is float32. Block families work on a layout whose block dimension is ``dim``
([..., nblocks, block] with dim -1, or [..., nblocks, block, inner] with dim -2); the scale
tensors keep that dimension with size 1, so they broadcast over the blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from .elemwise import ElemParams, finish, round_magnitude_
from .formats import FormatSpec


class QuantizerOptions(Protocol):
    """What a family's kernels read of a quant.quantizer.Quantizer (its validated options).
    A protocol here, so that the families and the Triton kernels name the type without
    importing the quantizer that dispatches to them."""

    spec: FormatSpec
    rounding: Optional[str]
    scale_mode: str
    block: int
    axis: int
    saturate: bool
    params: ElemParams

    def along(self, axis: int) -> "QuantizerOptions": ...

    @property
    def kernel(self) -> "QuantizerOptions": ...


@dataclass(frozen=True)
class Scales:
    """How x is scaled before its element cast and back after it.

    encoded values: ``x * encode`` (``x / encode`` when ``divide``; None: x itself);
    dequantized values: ``cast(encoded) * decode`` (then ``* global_decode``, a two-level
    family's per-tensor factor applied on its own, as Transformer Engine's NVFP4 does);
    ``poisoned``: blocks holding NaN/Inf, all NaN in the result (their scale would be a NaN
    code); ``stored``: the scale as the format stores it (MX: the E8M0 exponent; NVFP4: the E4M3
    block scale; per tensor: the float32 scale), for statistics.
    """

    encode: Optional[torch.Tensor] = None
    decode: Optional[torch.Tensor] = None
    divide: bool = False
    poisoned: Optional[torch.Tensor] = None
    stored: Optional[torch.Tensor] = None
    global_decode: Optional[torch.Tensor] = None

    def encoded(self, x: torch.Tensor) -> torch.Tensor:
        """The values the element cast rounds (a new tensor unless there is no scale)."""
        if self.encode is None:
            return x
        return x / self.encode if self.divide else x * self.encode

    @property
    def block_scale(self) -> Optional[torch.Tensor]:
        """The factor each block's cast values are multiplied back by (None: no scale)."""
        return self.decode


def cast_scaled(x: torch.Tensor, s: Scales, q: QuantizerOptions,
                noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dequantized values of x under scales ``s``: the element cast of the encoded values
    (quant.elemwise) as quantizer ``q`` configures it (its element constants, rounding and
    saturation), decoded, poisoned blocks set to NaN."""
    v = s.encoded(x)
    y = finish(round_magnitude_(v.abs(), q.params, q.rounding, noise), v, q.params, q.saturate)
    if s.decode is not None:
        y = y.mul_(s.decode)
    if s.global_decode is not None:
        y = y.mul_(s.global_decode)
    if s.poisoned is not None:
        y = y.masked_fill_(s.poisoned, float("nan"))
    return y


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite values (0 when there are none), as a 0-dim tensor.

    Branch-free (one fused pass when compiled): Inf/NaN are replaced by 0 before the max.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    a = x.abs()
    return torch.where(a < float("inf"), a, torch.zeros_like(a)).amax()


class ScalingFamily:
    """One way of choosing scales (``FormatSpec.scaling`` names it). A family provides:

    - :meth:`scales`: the Scales of float32 x in the family's layout;
    - :meth:`quantize` / :meth:`quantize_triton`: the torch and the Triton implementation of
      "scales, then cast", called by a quant.quantizer.Quantizer with itself (the validated
      options);
    - ``blocked``: whether the scales are per block along an axis (the layout of quant.layout).
    """

    scaling: str = ""
    blocked: bool = False
    #: whether the scales depend on the tensor's finite amax (per-tensor, two-level)
    uses_tensor_amax: bool = False
    #: whether ``scale_mode`` chooses among rules (MX: floor / ceil / rceil)
    has_scale_modes: bool = False
    #: what ``Scales.stored`` holds, as the what-if numbers name it (blocked families)
    stored_kind: str = ""

    def stored_bins(self, stored: torch.Tensor) -> torch.Tensor:
        """Integer histogram bins of stored scales (the what-if block-scale histogram)."""
        return stored

    def scales_from(self, amax_b: Optional[torch.Tensor], tensor_amax: Optional[torch.Tensor],
                    spec: FormatSpec, scale_mode: str) -> Scales:
        """The Scales from the block amax (blocked families: NaN/Inf propagated, the block
        dimension kept) and the finite tensor amax (``uses_tensor_amax``): what every consumer
        calls when it has formed these amaxes already (the one-pass what-if shares them)."""
        return Scales()

    def scales(self, x: torch.Tensor, spec: FormatSpec, scale_mode: str = "floor",
               dim: int = -1) -> Scales:
        """The Scales of float32 x (blocked families: x in blocks along ``dim``)."""
        amax_b = x.abs().amax(dim=dim, keepdim=True) if self.blocked else None
        tensor_amax = finite_amax(x) if self.uses_tensor_amax else None
        return self.scales_from(amax_b, tensor_amax, spec, scale_mode)

    def quantize(self, x: torch.Tensor, q: QuantizerOptions,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """The torch kernels: x quantized as ``q`` (a validated quant.quantizer.Quantizer:
        its element constants, rounding, saturation, scale mode, block and axis) configures."""
        raise NotImplementedError

    def quantize_triton(self, x: torch.Tensor, q: QuantizerOptions,
                        generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """The Triton kernels (quant.triton_kernels), bit-identical to :meth:`quantize`; a
        blocked family passes its scale rule (a Triton function, data) to the one block
        kernel, ``triton_kernels.quantize_blocks``."""
        raise NotImplementedError
