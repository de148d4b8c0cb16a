"""Where in the user's source: the line an op ran on, and the line that built the object a finding
is about (an optimizer, a GradScaler) or cast the parameters it steps (``model.half()``,
``model.to(torch.bfloat16)``).

A finding about an object's configuration (Adam's eps over float16 state, a GradScaler where
nothing is float16, parameters stepped in bfloat16) is fixed where the object was built or the
model cast, not where it ran; the run shows only where it ran. So while the audit runs,
``Optimizer.__init__``, ``GradScaler.__init__`` and ``Module``'s cast methods are wrapped to note
the user's line in weak registries (nothing is kept alive, nothing is added to the objects); the
recorder looks an object up when it runs. Objects built before the audit started (a decorated
step's optimizer) have no such line: their findings stay where they ran.
"""
from __future__ import annotations

import functools
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from quant.vocabulary import LOW_PRECISION_DTYPES

LOW_PRECISION = tuple(getattr(torch, name) for name in LOW_PRECISION_DTYPES)

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # training_profiler/
_SKIP_PREFIXES = (_TORCH_DIR, _OWN_DIR, "<frozen", os.path.dirname(os.__file__) + os.sep + "contextlib")


@dataclass(frozen=True)
class Where:
    """A user source line: the first frame outside torch and this package."""

    path: str
    line: int


_CODE_INTERNAL: dict[Any, bool] = {}


def user_frame(depth: int = 2, owner: object | None = None) -> Where:
    """The first frame outside torch, this package and the standard library's plumbing; with
    ``owner``, also outside ``owner``'s own methods (a user subclass's ``__init__`` calling
    ``super().__init__`` is not where the object was built: its caller is)."""
    f = sys._getframe(depth)
    while f is not None:
        code = f.f_code
        internal = _CODE_INTERNAL.get(code)
        if internal is None:
            internal = _CODE_INTERNAL[code] = code.co_filename.startswith(_SKIP_PREFIXES)
        if not internal and (owner is None or f.f_locals.get("self") is not owner):
            return Where(code.co_filename, f.f_lineno)
        f = f.f_back
    return Where("<unknown>", 0)


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: how findings and the record name a dtype."""
    return str(dtype).replace("torch.", "")


def place(where: Where, seen_from: Where) -> str:
    """``line N`` within the same file as ``seen_from``, else ``path:N``."""
    return f"line {where.line}" if where.path == seen_from.path else f"{where.path}:{where.line}"


#: Module cast methods -> the dtype a call casts to (None: no dtype change, e.g. .to(device))
CAST_DTYPE: dict[str, Callable[..., torch.dtype | None]] = {
    "half": lambda *a, **k: torch.float16,
    "bfloat16": lambda *a, **k: torch.bfloat16,
    "float": lambda *a, **k: torch.float32,
    "double": lambda *a, **k: torch.float64,
    "to": lambda *a, **k: torch._C._nn._parse_to(*a, **k)[1],
    "type": lambda dst_type, *a, **k: dst_type if isinstance(dst_type, torch.dtype) else None,
}


class Origins:
    """Weak registries, filled while installed: optimizer / GradScaler -> the line that built it;
    parameter -> (the line that cast it, the dtype); a parameter's ``data_ptr`` -> the parameter
    (``p.data`` is another tensor object over the same memory)."""

    def __init__(self) -> None:
        self.built: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.casts: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.params: dict[int, weakref.ref] = {}
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        self._wrap_init(torch.optim.Optimizer)
        self._wrap_init(torch.amp.GradScaler)
        for name in CAST_DTYPE:
            self._wrap_cast(name)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.params.clear()

    def note_params(self, module: torch.nn.Module, recurse: bool = False) -> None:
        """Make ``module``'s parameters findable by their memory (a module seen running or cast)."""
        for p in module.parameters(recurse=recurse):
            if p.numel():
                self.params[p.data_ptr()] = weakref.ref(p)

    def param_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The parameter ``t`` is (a Parameter, a leaf requiring grad) or aliases (``p.data``)."""
        if isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.is_leaf):
            return t
        ref = self.params.get(t.data_ptr()) if t.numel() else None
        p = ref() if ref is not None else None
        return p if p is not None and p.data_ptr() == t.data_ptr() else None

    def _wrap_init(self, cls: type) -> None:
        original = cls.__init__
        built = self.built

        @functools.wraps(original)
        def __init__(obj, *args, **kwargs):
            original(obj, *args, **kwargs)
            built[obj] = user_frame(2, owner=obj)

        cls.__init__ = __init__
        self._undo.append(lambda: setattr(cls, "__init__", original))

    def _wrap_cast(self, name: str) -> None:
        cls = torch.nn.Module
        original, dtype_of = cls.__dict__[name], CAST_DTYPE[name]
        origins = self

        @functools.wraps(original)
        def cast(module, *args, **kwargs):
            out = original(module, *args, **kwargs)
            dtype = dtype_of(*args, **kwargs)
            if dtype is not None and dtype.is_floating_point:
                where = user_frame(2, owner=module)
                for p in module.parameters():
                    if p.is_floating_point():
                        origins.casts[p] = (where, dtype_name(dtype))
                origins.note_params(module, recurse=True)
            return out

        setattr(cls, name, cast)
        self._undo.append(lambda: setattr(cls, name, original))
