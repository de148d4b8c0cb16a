"""A module imported on first use, or None where it cannot be imported (Triton absent).

Why an object: the outcome of the import (the module, or the ImportError that names what is
missing) is process state; it lives in the one instance that owns it (``quant.backends`` for
the Triton kernels, ``tensor_capture.state.STATE`` for the fused statistics kernel) with a
reset for tests, instead of a module-level dict. Imports no torch.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, Optional


class OptionalModule:
    """The module ``load()`` imports, once, on first :meth:`get`; None (and :attr:`error`) when
    it fails. ``load`` is a function whose body is the import statement, so the import graph
    (the no-loop check, the layering test) still sees the edge."""

    __slots__ = ("load", "module", "error", "_tried")

    def __init__(self, load: Callable[[], ModuleType]) -> None:
        self.load = load
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
                self.module = self.load()
            except ImportError as exc:
                self.error = exc
            self._tried = True
        return self.module
