"""Element-only families: no scale (``fp8_e4m3``, ``hifp8``, ``bf16`` ...) and the identity
(``fp32``: a copy). The element cast itself is quant.elemwise's (torch) and
quant.triton_kernels' ``_cast`` (its Triton implementation)."""
from __future__ import annotations

from . import accel, cpu_blocks
from .backends import triton_kernels
from .formats import SCALING_IDENTITY, SCALING_NONE
from .layout import noise
from .scales import Scales, ScalingFamily, cast_scaled


def _cast(x, q, nz=None):
    """The torch kernel (compiled by quant.accel): the element cast ``q`` configures."""
    return cast_scaled(x, Scales(), q, nz)


class IdentityFamily(ScalingFamily):
    """No quantization: the input is returned as a copy on both backends."""

    scaling = SCALING_IDENTITY

    def quantize(self, x, q, generator=None):
        return x.clone()

    quantize_triton = quantize


class ElementFamily(ScalingFamily):
    """The plain element cast: Scales() (nothing to encode or decode). A float32 CPU tensor
    takes quant.cpu_blocks' C cast where it applies (nearest-even on a fixed mantissa, ties
    away on HiF8's tapered grid; probed bit for bit against ``reference``), else the torch
    kernel."""

    scaling = SCALING_NONE

    def quantize(self, x, q, generator=None):
        lib = cpu_blocks.kernels_for(x, q)
        if lib is not None:
            return self.quantize_c(lib, x, q)
        return accel.run(_cast, x, (q.kernel,), noise(x.shape, x.device, generator, q.rounding))

    def quantize_c(self, lib, x, q):
        return cpu_blocks.elem_cast(lib, x, q)

    def reference(self, x, q):
        """The torch kernel on x (uncompiled): what the C path is probed against."""
        return _cast(x, q.kernel)

    def quantize_triton(self, x, q, generator=None):
        nz = noise(x.shape, x.device, generator, q.rounding)
        return triton_kernels().cast_elements(x.contiguous(), q, nz)


IDENTITY = IdentityFamily()
ELEMENT = ElementFamily()
