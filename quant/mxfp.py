"""MX helpers by element-format name: quant_mx fake-quantizes with the MX format of an element
format (quant.quantize's options; ``analyze=True`` prints the underflow warning above 0.1 %)."""
from __future__ import annotations

from typing import Optional

import torch

from .fakequant import quantize
from .formats import MX_OF_ELEMENT  # element-format name -> MX format name (from FORMATS)


def mx_format_for(elem_format: str) -> str:
    """MX format name for an element name ('fp8_e4m3' -> 'mxfp8'); MX names pass through."""
    if elem_format in MX_OF_ELEMENT.values():
        return elem_format
    try:
        return MX_OF_ELEMENT[elem_format]
    except KeyError:
        raise ValueError(f"unknown MX element format {elem_format!r}; valid: "
                         f"{', '.join(MX_OF_ELEMENT)}") from None


def quant_mx(x: torch.Tensor, elem_format: str = "fp8_e4m3", *, block_size: int = 32,
             axis: int = -1, scale_mode: str = "floor", rounding: Optional[str] = None,
             analyze: Optional[bool] = None) -> torch.Tensor:
    """MX fake quantization by element-format name (see quant.quantize for the options)."""
    return quantize(x, mx_format_for(elem_format), block_size=block_size, axis=axis,
                    scale_mode=scale_mode, rounding=rounding, analyze=analyze)
