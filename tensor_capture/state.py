"""The one flag the patched Megatron hot path reads.

Why a separate object: the patched files check ``STATE.active`` (one attribute lookup) on
every GEMM; everything else is imported only when it is true. Set from the environment at
import (cheap, no validation) and refreshed whenever a saver is configured.
"""
from __future__ import annotations

from .config import env_requests_activity  # noqa: F401  (the facade imports it from here)


class _State:
    __slots__ = ("active", "emulate", "emulate_attention", "quant_type", "plan", "current_linear",
                 "paused", "warn_underflow", "inspector")

    def __init__(self) -> None:
        self.active = False             # capture enabled or emulation on
        self.emulate = False            # CUSTOM_QUANT_TYPE names a format to emulate
        self.emulate_attention = False  # ... and attention GEMMs are emulated too
        self.quant_type: str | None = None
        self.plan = None                # quant.precision_plan.PrecisionPlan (CUSTOM_QUANT_PLAN)
        self.current_linear = None      # site of the linear module whose forward is running
        self.paused = False             # a forward-only (evaluation) schedule call: capture nothing
        self.warn_underflow = False     # emulating with underflow_warnings on (tensor_capture.underflow)
        # inspector(module, site, iteration, {name: tensor}) for attention tensors: the debug
        # API route of te_integration (saver.set_inspector); None: off
        self.inspector = None


STATE = _State()

