"""nvdlfw-inspect, imported in one place: a missing package is one line naming the extra.

Why: the debug features, the ``lowp`` namespace and the attention route all need it; a user
without it should read which extra to install, not an ImportError traceback from a feature file.
"""
from __future__ import annotations

from typing import Any, Optional

from lowp_common import UserError

INSTALL_HINT = ("the Transformer Engine debug features need nvdlfw-inspect: "
                "pip install 'megatron-lowp-tools[te]' (or pip install nvdlfw-inspect==0.2.2)")


def require() -> Any:
    """The ``nvdlfw_inspect`` package, or UserError saying which extra to install."""
    try:
        import nvdlfw_inspect
        import nvdlfw_inspect.api
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return nvdlfw_inspect


def debug_iteration(default: Optional[int] = None) -> Optional[int]:
    """The debug API's step count (what TE passes as ``iteration``), else ``default``."""
    try:
        import nvdlfw_inspect.api as debug_api
    except ImportError:
        return default
    manager = debug_api.DEBUG_MANAGER
    return default if manager is None else getattr(manager, "_trainer_iteration_count", default)


def schedule(freq: int, start: int, end: int, pairs: Optional[list],
             iteration: int) -> tuple[bool, Optional[int]]:
    """(run now, next iteration that runs or None) of a feature's freq / start / end /
    start_end_list, with nvdlfw-inspect's own rule for "runs at this step"."""
    from nvdlfw_inspect.logging import enable_logging_at_current_step as runs

    now = runs(iteration, freq, start, end, pairs)
    intervals = [tuple(p) for p in pairs] if pairs else [(start, end)]
    nxt = None
    for lo, hi in intervals:
        first = max(iteration + 1, lo)
        cand = first + (-first) % freq
        if hi != -1 and cand > hi:
            continue
        if runs(cand, freq, start, end, pairs) and (nxt is None or cand < nxt):
            nxt = cand
    return now, nxt
