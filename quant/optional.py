"""A module imported on first use, or None where it cannot be imported (Triton absent).

Why an object: the outcome of the import (the module, or the ImportError that names what is
missing) is process state; it lives in the one instance that owns it (``quant.backends`` for
the Triton kernels, ``tensor_capture.state.STATE`` for the fused statistics kernel) with a
reset for tests, instead of a module-level dict. Imports no torch.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional


class OptionalModule:
    """``name`` imported once, on first :meth:`get`; None (and :attr:`error`) when it fails."""

    __slots__ = ("name", "module", "error", "_tried")

    def __init__(self, name: str) -> None:
        self.name = name
        self.reset()

    def reset(self) -> None:
        """Forget the outcome (tests): the next :meth:`get` imports again."""
        self.module: Optional[ModuleType] = None
        self.error: Optional[ImportError] = None
        self._tried = False

    def get(self) -> Optional[ModuleType]:
        """The module, or None when its import raised ImportError (kept in :attr:`error`)."""
        if not self._tried:
            try:
                self.module = importlib.import_module(self.name)
            except ImportError as exc:
                self.error = exc
            self._tried = True
        return self.module
