"""Everything tensor capture keeps per process, in one object with one reset.

Why one object: the patched Megatron hot path checks ``STATE.active`` (one attribute lookup) on
every GEMM, and everything else is imported only when it is true; and a new capture session
(``configure()``, ``reset_tensor_saver()``) must forget the previous one completely, which is
:meth:`CaptureState.reset` and nothing else. The process-wide saver (tensor_capture.saver) owns
it: it sets the flags from its config and calls the reset; other modules read the flags and keep
their per-session books as :meth:`CaptureState.session` parts (iteration numbering, emulation's
delayed-scaling state, the underflow warning's turns), so the saver never imports them. A part
with something to say in the capture's stop line defines ``stop_note()`` (:meth:`stop_notes`).

What a reset keeps: what describes the process rather than a session (the inspector route, the
model's sites, the outcome of importing the fused statistics kernel, the handle of the ranks'
latest agreement, which tensor_capture.budget explains).

What is deliberately not here: the call a linear layer's backward needs (site, iteration,
micro-batch of its forward) travels on the autograd ``ctx`` (tensor_capture.hooks), because
several forwards (micro-batches, pipeline stages) run before their backwards.
"""
from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any, TypeVar

from quant.optional import OptionalModule

from .config import env_requests_activity  # noqa: F401  (the facade imports it from here)

_Part = TypeVar("_Part")


def _load_stats_kernel() -> ModuleType:
    from . import stats_kernel

    return stats_kernel


class CaptureState:
    """Hot-path flags, the process-wide saver, model sites and per-session parts."""

    __slots__ = ("active", "emulate", "emulate_attention", "quant_type", "plan", "guard",
                 "current_linear",
                 "paused", "warn_underflow", "inspector", "saver", "running_attention", "sites",
                 "discovery", "stats_kernel", "agreement_work", "_session")

    def __init__(self) -> None:
        # inspector(module, site, iteration, {name: tensor}) for attention tensors: the debug
        # API route of te_integration (saver.set_inspector); None: off. Process-wide, set
        # outside any capture session, so a reset keeps it.
        self.inspector: Any = None
        # module -> tensor_capture.sites.Site: describes the model, which outlives a capture
        # session (a reset keeps it; weak keys let a dropped model go)
        self.sites: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self.discovery: list[Any] = []     # handle of the global module pre-hook (tensor_capture.sites)
        # the fused Triton statistics pass, imported on first CUDA tensor (None without Triton)
        self.stats_kernel = OptionalModule(_load_stats_kernel)
        # work handle of the ranks' latest agreement (tensor_capture.budget.max_over_ranks):
        # replaced by the next one, whichever session it belongs to
        self.agreement_work: Any = None
        self.reset()

    def reset(self) -> None:
        """Forget the capture session: flags off, no saver, every session part dropped."""
        self.active = self.inspector is not None   # capture enabled, emulation on, or an inspector
        self.emulate = False            # CUSTOM_QUANT_TYPE names a format to emulate
        self.emulate_attention = False  # ... and attention GEMMs are emulated too
        self.quant_type: str | None = None
        self.plan: Any = None           # quant.precision_plan.PrecisionPlan (CUSTOM_QUANT_PLAN)
        self.guard: Any = None          # tensor_capture.guard.Guard (TENSOR_SAVE_GUARD)
        self.current_linear: Any = None     # site of the linear module whose forward is running
        self.running_attention: Any = None  # site of the attention module now in forward
        self.paused = False             # a forward-only (evaluation) schedule call: capture nothing
        self.warn_underflow = False     # emulating with underflow_warnings on (tensor_capture.underflow)
        self.saver: Any = None          # the process-wide TensorSaver (tensor_capture.saver)
        self._session: dict[type, Any] = {}

    def session(self, kind: type[_Part]) -> _Part:
        """This session's ``kind()`` (made on first use; a reset drops it)."""
        part = self._session.get(kind)
        if part is None:
            part = self._session[kind] = kind()
        return part

    def forget(self, kind: type) -> None:
        """Drop this session's ``kind`` part alone (its next use starts afresh)."""
        self._session.pop(kind, None)

    def stop_notes(self) -> list[str]:
        """The clauses this session's parts add to the stop line (``part.stop_note()``)."""
        notes = (getattr(part, "stop_note", lambda: None)() for part in self._session.values())
        return [note for note in notes if note]


STATE = CaptureState()
