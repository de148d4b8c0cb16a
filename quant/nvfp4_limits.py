"""The two levels of NVFP4, from the format table: E2M1 elements and E4M3 block scales. Their own
module because both NVFP4 implementations read them, the torch family (``family_nvfp4``) and the
Triton kernels, and the family picks its backend: neither may import the other."""
from __future__ import annotations

from .elemwise import ElemParams
from .formats import FORMATS

#: the element and the block-scale formats of the two levels
ELEMENT_MAX = FORMATS["fp4_e2m1"].max_normal
SCALE_FORMAT = FORMATS["fp8_e4m3"]
SCALE_PARAMS = ElemParams.of(SCALE_FORMAT)
SCALE_MIN = SCALE_FORMAT.min_subnormal
SCALE_MAX = SCALE_FORMAT.max_normal
