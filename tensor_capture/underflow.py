"""The seed's pre-quantization underflow warning, on the way, while emulating.

Why a module of its own: the warning belongs to emulation, not to capture; it must never
change a result and must not flood the log. Each emulated GEMM operand is analysed with
``quant.analyze_quantization`` (given the quantized tensor, so nothing is quantized twice) and
the warning is ``QuantAnalysis.warning_message()`` (flush-to-zero above 0.1 %), printed at most
once per operand kind per iteration; a kind that has warned is not analysed again in that
iteration. Off (``underflow_warnings: false``, or no emulation): one flag check per operand.
"""
from __future__ import annotations

import sys

import torch


class _Seen:
    __slots__ = ("iteration", "kinds")

    def __init__(self) -> None:
        self.iteration: int | None = None
        self.kinds: set[str] = set()


_SEEN = _Seen()


def reset() -> None:
    _SEEN.iteration = None
    _SEEN.kinds = set()


def check(x: torch.Tensor, quantized: torch.Tensor, fmt: str, axis: int, kind: str,
          site: str | None, iteration: int | None) -> str | None:
    """Analyse ``x`` (before quantization to ``fmt``) and print the warning when due."""
    if iteration != _SEEN.iteration:
        _SEEN.iteration = iteration
        _SEEN.kinds = set()
    if kind in _SEEN.kinds or not x.is_floating_point() or x.numel() == 0:
        return None
    import quant

    try:
        report = quant.analyze_quantization(x.detach(), fmt, axis=axis,
                                            quantized=quantized.detach())
    except Exception as exc:  # advisory only: never stop training for it
        _SEEN.kinds.add(kind)
        print(f"tensor capture: underflow analysis of {kind} skipped ({exc})".splitlines()[0],
              file=sys.stderr, flush=True)
        return None
    msg = report.warning_message()
    if msg is None:
        return None
    _SEEN.kinds.add(kind)
    where = f" {site}" if site else ""
    it = "?" if iteration is None else iteration
    text = f"tensor capture: iteration {it}, {kind}{where}:\n{msg}"
    print(text, file=sys.stderr, flush=True)
    return text
