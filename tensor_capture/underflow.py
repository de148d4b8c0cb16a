"""The pre-quantization warning, on the way, while emulating: a finding, said once.

Why a module of its own: the warning belongs to emulation, not to capture; it must never
change a result, must not flood the log, and must not make emulation several times slower.

What is "bad" is the one judgment of :mod:`quant.format_loss`: the operand's SQNR in the
format against the format's own SQNR on Gaussian data of the same shape along the same axis
(values in a subnormal range count by what they lose, not by where they sit). The overflow /
underflow / flush-to-zero counts of ``quant.analyze_quantization`` (given the quantized tensor,
so nothing is quantized twice) are the evidence the line shows.

Said once per (module, operand, format), and again only when its level changes, with
hysteresis: a rise is said at once (the first sighting is the news), a fall (down to MEDIUM, or
back within the margin) only once it has held ``underflow_hold`` iterations (every judgment of
that operand below the level said, the first and the last that far apart). An operand whose
loss hovers around a margin, up one judgment and down the next, is said once, not at every
crossing (issue 48: 18 lines for one operand in 300 iterations). The count goes into the
capture's stop line.

Cost bound: an analysis makes several passes over its operand, so each iteration analyses ONE
operand per kind, taking the modules in turn (round robin over the modules seen with that kind):
about one analysis per kind per iteration, whatever the depth of the model and the number of
micro-batches. Off (``underflow_warnings: false``, or no emulation): one flag check per operand.
"""
from __future__ import annotations

import sys

import torch

from .config import CaptureConfig
from .state import STATE

_ICON = {"high": "\U0001f534", "medium": "\U0001f7e1", "none": "\U0001f7e2"}
#: the levels in order (quant.format_loss.loss_severity's names): a higher rank is worse
_RANK = {"none": 0, "medium": 1, "high": 2}


class _Turns:
    """This session's turns and levels (a STATE session part)."""
    __slots__ = ("iteration", "done", "seen", "checked", "levels", "falls", "said")

    def __init__(self) -> None:
        self.iteration: int | None = None
        self.done: set[str] = set()                    # kinds analysed (or warned) this iteration
        self.seen: dict[str, set[str | None]] = {}     # kind -> modules met so far
        self.checked: dict[str, set[str | None]] = {}  # kind -> modules analysed this round
        self.levels: dict[tuple, str] = {}             # (module, kind, format) -> level last said
        self.falls: dict[tuple, int] = {}              # ... -> first iteration below it (not said)
        self.said = 0                                  # warnings printed this session

    def stop_note(self) -> str | None:
        """The stop line's clause (STATE.stop_notes): how many warnings, how many still above."""
        if not self.said:
            return None
        keys = sum(1 for v in self.levels.values() if v != "none")
        return (f"{self.said} pre-quantization warning(s) ({keys} module x operand x format now "
                "above the margin)")


def _turns() -> _Turns:
    return STATE.session(_Turns)


def reset() -> None:
    """Forget the turns and levels said (the next warning starts afresh)."""
    STATE.forget(_Turns)


def _my_turn(t: _Turns, kind: str, site: str | None) -> bool:
    seen = t.seen[kind]
    checked = t.checked.setdefault(kind, set())
    if checked >= seen:            # every module had its turn: a new round
        checked.clear()
    if site in checked:
        return False
    checked.add(site)
    return True


def message(kind: str, site: str | None, iteration: int | None, loss, report, *,
            previous: str, since: int | None = None) -> str:
    """The one line said for a (module, operand, format) whose level changed (``since``: the
    first iteration of a fall that held)."""
    where = f" {site}" if site else ""
    it = "?" if iteration is None else iteration
    head = f"tensor capture: iteration {it}, {kind}{where}:"
    held = "" if since is None or since == iteration else f" since iteration {since}"
    if loss.severity == "none":
        return (f"{head} {_ICON['none']} back within the margin in {loss.format}{held} (SQNR "
                f"{loss.sqnr_db:.1f} dB, baseline {loss.baseline_db:.1f} dB; was "
                f"{previous.upper()})")
    change = "" if previous == "none" else f", was {previous.upper()}{held}"
    return (f"{head} {_ICON[loss.severity]} {loss.format} loses {loss.deficit_db:.1f} dB more "
            f"than on Gaussian data (SQNR {loss.sqnr_db:.1f} vs {loss.baseline_db:.1f} dB): "
            f"severity {loss.severity.upper()}{change}; underflow {report.underflow_ratio:.2%}, "
            f"flushed to zero {report.flush_to_zero_ratio:.2%}, overflow "
            f"{report.overflow_ratio:.2%} (said once per module, operand and format, again when "
            "the level changes: a rise at once, a fall once it holds)")


def hold_iterations() -> int:
    """How long a fall must hold before it is said: the session's ``underflow_hold``."""
    config = getattr(STATE.saver, "config", None)
    return int(getattr(config, "underflow_hold", CaptureConfig.underflow_hold))


def level_to_say(t: _Turns, key: tuple, severity: str, iteration: int | None,
                 hold: int) -> tuple[str, int | None] | None:
    """(the level to say now, the first iteration of the fall it ends) for ``key`` judged
    ``severity`` at ``iteration``; None when nothing is to be said: the level said stands, or a
    fall has not held ``hold`` iterations yet (any judgment at or above the level said
    cancels it)."""
    said = t.levels.get(key, "none")
    if _RANK[severity] >= _RANK[said]:
        t.falls.pop(key, None)
        return None if severity == said else (severity, None)
    now = 0 if iteration is None else iteration
    since = t.falls.setdefault(key, now)
    if now - since < hold:
        return None
    del t.falls[key]
    return severity, since


def check(x: torch.Tensor, quantized: torch.Tensor, fmt: str, axis: int, kind: str, *,
          site: str | None, iteration: int | None) -> str | None:
    """Judge ``x`` (before quantization to ``fmt``) when it is its turn; print a line when the
    level of (site, kind, fmt) changed and the change holds (:func:`level_to_say`)."""
    t = _turns()
    if iteration != t.iteration:
        t.iteration = iteration
        t.done = set()
    t.seen.setdefault(kind, set()).add(site)      # every module takes its turn later
    if kind in t.done or not x.is_floating_point() or x.numel() == 0:
        return None
    if not _my_turn(t, kind, site):
        return None
    t.done.add(kind)
    import quant
    from quant.format_loss import judge

    try:
        q = quantized.detach()
        report = quant.analyze_quantization(x.detach(), fmt, axis=axis, quantized=q,
                                            summaries=False)
        loss = judge(x, fmt, axis, quantized=q)
    except Exception as exc:  # advisory only: never stop training for it
        print(f"tensor capture: pre-quantization analysis of {kind} skipped ({exc})".splitlines()[0],
              file=sys.stderr, flush=True)
        return None
    key = (site, kind, loss.format)
    previous = t.levels.get(key, "none")
    change = level_to_say(t, key, loss.severity, iteration, hold_iterations())
    if change is None:
        return None
    t.levels[key] = loss.severity
    text = message(kind, site, iteration, loss, report, previous=previous, since=change[1])
    t.said += 1
    print(text, file=sys.stderr, flush=True)
    return text
