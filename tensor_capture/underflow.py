"""The seed's pre-quantization underflow warning, on the way, while emulating.

Why a module of its own: the warning belongs to emulation, not to capture; it must never
change a result, must not flood the log, and must not make emulation several times slower.
Emulated GEMM operands are analysed with ``quant.analyze_quantization`` (given the quantized
tensor, so nothing is quantized twice); the warning is ``QuantAnalysis.warning_message()``
(flush-to-zero above 0.1 %), printed at most once per operand kind per iteration.

Cost bound: an analysis makes several passes over its operand (several times a quantization),
so each iteration analyses ONE operand per kind, taking the modules in turn (round robin over
the modules seen with that kind), so every module is checked once every N iterations for N
modules. The cost is then about one analysis per kind per iteration, whatever the depth of the
model and the number of micro-batches. Off (``underflow_warnings: false``, or no emulation): one
flag check per operand.
"""
from __future__ import annotations

import sys

import torch

from .saver import on_new_session


class _Turns:
    __slots__ = ("iteration", "done", "seen", "checked")

    def __init__(self) -> None:
        self.iteration: int | None = None
        self.done: set[str] = set()                    # kinds analysed (or warned) this iteration
        self.seen: dict[str, set[str | None]] = {}     # kind -> modules met so far
        self.checked: dict[str, set[str | None]] = {}  # kind -> modules analysed this round


_T = _Turns()


def reset() -> None:
    _T.iteration = None
    _T.done = set()
    _T.seen = {}
    _T.checked = {}


on_new_session(reset)


def _my_turn(kind: str, site: str | None) -> bool:
    seen = _T.seen[kind]
    checked = _T.checked.setdefault(kind, set())
    if checked >= seen:            # every module had its turn: a new round
        checked.clear()
    if site in checked:
        return False
    checked.add(site)
    return True


def check(x: torch.Tensor, quantized: torch.Tensor, fmt: str, axis: int, kind: str,
          site: str | None, iteration: int | None) -> str | None:
    """Analyse ``x`` (before quantization to ``fmt``) when it is its turn; print the warning."""
    if iteration != _T.iteration:
        _T.iteration = iteration
        _T.done = set()
    _T.seen.setdefault(kind, set()).add(site)      # every module takes its turn later
    if kind in _T.done or not x.is_floating_point() or x.numel() == 0:
        return None
    if not _my_turn(kind, site):
        return None
    _T.done.add(kind)
    import quant

    try:
        report = quant.analyze_quantization(x.detach(), fmt, axis=axis,
                                            quantized=quantized.detach())
    except Exception as exc:  # advisory only: never stop training for it
        print(f"tensor capture: underflow analysis of {kind} skipped ({exc})".splitlines()[0],
              file=sys.stderr, flush=True)
        return None
    msg = report.warning_message()
    if msg is None:
        return None
    where = f" {site}" if site else ""
    it = "?" if iteration is None else iteration
    text = f"tensor capture: iteration {it}, {kind}{where}:\n{msg}"
    print(text, file=sys.stderr, flush=True)
    return text
