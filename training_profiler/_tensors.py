"""Small helpers shared by the hook-based tools."""
from __future__ import annotations

from typing import Any

import torch


def first_tensor(out: Any) -> torch.Tensor | None:
    """The tensor a module returned: itself, or the first item of a tuple/list (Megatron's
    parallel linears return ``(output, bias)``)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None
