"""The table of scaling families: ``FormatSpec.scaling`` -> the family object.

Adding a family: one file (quant/family_<name>.py, a :class:`quant.scales.ScalingFamily` with
its ``scales``, torch ``quantize`` and Triton ``quantize_triton``, both given the configured
quant.quantizer.Quantizer) and one row here; its formats are rows of quant.formats with that
``scaling``; a blocked family's Triton scale rule is a ``triton_kernels.BlockScaleRule`` (data for
the one block kernel). quant.quantizer, quant.analysis, quant.whatif,
quant.whatif_onepass and the recipes reach a family only through this table.
"""
from __future__ import annotations

from .family_element import ELEMENT, IDENTITY
from .family_mx import MX
from .family_nvfp4 import NVFP4
from .family_tensor import TENSOR
from .formats import FormatSpec
from .scales import ScalingFamily

FAMILIES: dict[str, ScalingFamily] = {f.scaling: f for f in (IDENTITY, ELEMENT, TENSOR, MX,
                                                              NVFP4)}


def family_of(spec: FormatSpec) -> ScalingFamily:
    """The family that scales ``spec``."""
    return FAMILIES[spec.scaling]
