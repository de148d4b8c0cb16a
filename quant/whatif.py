"""What-if numerics: what quantizing one tensor to a format would do, as plain numbers.

Why one function: capture stores these numbers per tensor and per format in its metadata, the
report's ``numerics.csv`` reads them back (and recomputes them from a saved tensor when an old
capture lacks them), and tests re-derive them; all go through :func:`whatif`, which only
combines the single definitions of :mod:`quant.metrics` (SQNR, relative error),
:mod:`quant.analysis` (overflow / underflow / flush-to-zero, per block) and
:mod:`quant.families` (the scales: MX E8M0 exponents, NVFP4 E4M3 block scales).

Keys of the returned dict (``WHATIF_*`` below; JSON-ready):
- ``sqnr_db``, ``rel_error`` (a fraction), ``overflow_ratio``, ``underflow_ratio``,
  ``flush_ratio`` (over all elements), ``axis`` (the axis blocks run along);
- block formats (MX, NVFP4) also: ``block_size``, ``axis_length``, ``blocks``,
  ``short_axis`` (True when the axis is shorter than one block: every block is the zero-padded
  remainder, so the block numbers describe padded blocks; marked, not dropped),
  ``block_scale`` = {``kind``, ``min``, ``max``, ``std``, ``hist``} over the blocks holding a
  finite nonzero value; MX: kind ``e8m0_exponent``, the shared exponent
  ``floor(log2(block amax)) - emax_elem``, histogram per exponent; NVFP4: kind ``e4m3_scale``,
  the E4M3 block scale value, histogram per binade ``floor(log2(scale))``;
  ``block_clipped_hist`` / ``block_flushed_hist``: ``counts[k]`` = blocks with k elements that
  overflow (clip to +-max) / flush to zero; ``block_dynamic_range_hist``: per block
  ``floor(log2 amax) - floor(log2 min nonzero |x|)`` (binades spanned by the block's values).
  Every ``hist`` is ``{"min_bin": b0, "counts": [n(b0), n(b0 + 1), ...]}``.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Union

import torch

from . import metrics
from .analysis import analyze_quantization
from .elemwise import float_exponent
from .fakequant import quantize
from .families import family_of
from .formats import DEFAULT_SCALE_MODE, WHATIF_FORMATS, FormatSpec, get_format
from .layout import to_blocks
from .quantizer import Quantizer
from .whatif_record import SCALE_KIND_MX, SCALE_KIND_NVFP4, block_dict, element_dict, int_histogram

__all__ = ["DEFAULT_WHATIF_FORMATS", "SCALE_KIND_MX", "SCALE_KIND_NVFP4", "whatif",
           "whatif_set", "int_histogram", "is_block_format", "block_dict", "element_dict"]

#: the what-if set capture uses unless configured otherwise (defined in quant.formats)
DEFAULT_WHATIF_FORMATS = WHATIF_FORMATS


def is_block_format(fmt: Union[str, FormatSpec]) -> bool:
    """Does ``fmt`` scale blocks (MX, NVFP4), so it has block-scale numbers?"""
    return family_of(get_format(fmt)).blocked


def _block_numbers(x32: torch.Tensor, spec: FormatSpec, axis: int, block: int,
                   per_block: dict) -> dict[str, Any]:
    xb, _ = to_blocks(x32, axis, block)
    a = xb.abs()
    amax = a.amax(dim=-1)
    live = torch.isfinite(amax) & (amax > 0)
    # the scales the quantizer chose (the format's defaults: whatif's docstring)
    scale = family_of(spec).scales(xb, spec, DEFAULT_SCALE_MODE).stored.squeeze(-1)[live]
    inf = torch.tensor(math.inf, dtype=a.dtype)
    mnz = torch.where(torch.isfinite(a) & (a > 0), a, inf).amin(dim=-1)
    dyn = float_exponent(amax[live]) - float_exponent(mnz[live])
    n = x32.shape[axis] if x32.dim() else 1
    return block_dict(spec, block, n, int(amax.numel()), live_scales=scale,
                      dynamic_range_hist=int_histogram(dyn), clipped=per_block["overflow"],
                      flushed=per_block["flush_to_zero"])


def whatif(x: torch.Tensor, fmt: Union[str, FormatSpec], axis: int = -1) -> dict[str, Any]:
    """The numbers of quantizing ``x`` to ``fmt`` with blocks along ``axis`` (module docstring).

    Uses the format's defaults (rounding, floor MX scales, saturation), as training emulation
    does. Raises ValueError for an empty or non-floating tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        raise ValueError("whatif: needs a non-empty floating-point tensor")
    spec = get_format(fmt)
    with torch.no_grad():
        x = x.detach()
        if x.dim() == 0:
            x, axis = x.reshape(1), 0
        axis = axis % x.dim()
        quantizer = Quantizer.of(spec, axis=axis)
        q = quantize(x, quantizer)
        an = analyze_quantization(x, quantizer, quantized=q, summaries=False)
        out = element_dict(axis, metrics.sqnr(x, q), metrics.relative_error(x, q),
                           overflow=an.overflow_count, underflow=an.underflow_count,
                           flushed=an.flush_to_zero_count, total=an.total)
        if an.per_block is not None and is_block_format(spec):
            out.update(_block_numbers(x.float(), spec, axis, an.block_size, an.per_block))
        return out


def whatif_set(x: torch.Tensor, formats: Iterable[str], axis: int = -1) -> dict[str, Any]:
    """:func:`whatif` of each format: ``{format: numbers}``; a format that fails gives
    ``{"error": first line}`` (advisory numbers must never stop a capture).

    The formats :mod:`quant.whatif_onepass` supports (the default set among them) are computed
    together in one pass, with the same numbers; the others one by one."""
    from .whatif_onepass import whatif_onepass

    formats = list(formats)
    together = whatif_onepass(x, formats, axis)
    out: dict[str, Any] = {}
    for name in formats:
        if name in together:
            out[name] = together[name]
            continue
        try:
            out[name] = whatif(x, name, axis)
        except Exception as exc:
            out[name] = {"error": (str(exc).splitlines() or [type(exc).__name__])[0][:200]}
    return out
