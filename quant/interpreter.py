"""Whether Triton kernels run in Triton's CPU interpreter: one reading of TRITON_INTERPRET for
the backend choice (``backends``) and the kernels' bit-space bfloat16 path (``triton_kernels``).
"""
from __future__ import annotations

import os

from .vocabulary import TRUE_WORDS


def triton_interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in TRUE_WORDS
