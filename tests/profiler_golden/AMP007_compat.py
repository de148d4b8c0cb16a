"""Deprecated names are reported only where they run."""
from typing import Optional

import torch

try:
    from torch.amp import GradScaler
except ImportError:
    from torch.cuda.amp import GradScaler            # no finding: fallback for old torch

if hasattr(torch, "amp") and hasattr(torch.amp, "autocast"):
    autocast = torch.amp.autocast
else:
    autocast = torch.cuda.amp.autocast              # no finding: old-torch branch


def make(scaler: Optional["torch.cuda.amp.GradScaler"] = None) -> "GradScaler":
    return scaler or GradScaler("cuda")


def step(x):
    with torch.cuda.amp.autocast():                 # finding: a live deprecated call
        return x * 2
