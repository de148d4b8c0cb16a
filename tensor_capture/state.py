"""The one flag the patched Megatron hot path reads.

Why a separate object: the patched files check ``STATE.active`` (one attribute lookup) on
every GEMM; everything else is imported only when it is true. Set from the environment at
import (cheap, no validation) and refreshed whenever a saver is configured.
"""
from __future__ import annotations

import os


class _State:
    __slots__ = ("active", "emulate", "emulate_attention", "quant_type", "current_linear",
                 "paused", "warn_underflow")

    def __init__(self) -> None:
        self.active = False             # capture enabled or emulation on
        self.emulate = False            # CUSTOM_QUANT_TYPE names a format to emulate
        self.emulate_attention = False  # ... and attention GEMMs are emulated too
        self.quant_type: str | None = None
        self.current_linear = None      # site of the linear module whose forward is running
        self.paused = False             # a forward-only (evaluation) schedule call: capture nothing
        self.warn_underflow = False     # emulating with underflow_warnings on (tensor_capture.underflow)


STATE = _State()


def env_requests_activity(env: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    """True when the environment asks for capture or emulation (validated later)."""
    enabled = env.get("TENSOR_SAVE_ENABLED", "").strip().lower() not in ("", "0", "false", "no", "off")
    quant = env.get("CUSTOM_QUANT_TYPE", "").strip().lower() not in ("", "fp32", "none")
    return enabled or quant or bool(env.get("TENSOR_SAVE_CONFIG", "").strip())
