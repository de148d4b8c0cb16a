"""Range limits (max normal, min normal, min subnormal) of dtypes and quant formats.

Used only to compute overflow/underflow statistics for files whose capture did not
store them; limits of quant formats come from ``quant`` (never restated here).
"""
from __future__ import annotations

from functools import lru_cache

import torch

Limits = tuple[float, float, float]


@lru_cache(maxsize=None)
def format_limits(name: str) -> Limits | None:
    """Limits for ``torch.<dtype>`` names and per-tensor quant formats; None if unknown.

    Block-scaled formats (MX, NVFP4) have no fixed per-tensor range, so they get None.
    """
    name = _DTYPE_ALIASES.get(name, name) if _quant_spec(name) is None else name
    if name.startswith("torch."):
        dtype = getattr(torch, name[len("torch."):], None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            fi = torch.finfo(dtype)
            return float(fi.max), float(fi.tiny), float(fi.tiny * fi.eps)
        return None
    spec = _quant_spec(name)
    if spec is None:
        return None
    if getattr(spec, "block_size", None):
        return None
    try:
        return float(spec.max_normal), float(spec.min_normal), float(spec.min_subnormal)
    except (AttributeError, TypeError):
        return None


# Quant-type names that are plain dtypes, used when quant does not describe them.
_DTYPE_ALIASES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def _quant_spec(name: str):
    try:
        import quant  # optional: the numerics core may be absent or not know the name

        return quant.get_format(name)
    except Exception:
        return None
