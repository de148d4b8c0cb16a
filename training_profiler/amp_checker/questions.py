"""Questions about code that ask each other, answered once each, cycles included.

The value analysis (``values``) and the project's call sites and names (``project``) are
questions whose answers need other answers: what ``ctx`` holds needs what the function that made
it returns, which needs what its callers pass, which may need ``ctx`` again. A ``Questions``
(one per scanned project, ``project.Project.questions``: no process-wide state) answers
them as one fixpoint across every module of a scan; ``deep_stack`` gives it the stack that the
long chains of large projects need. Nothing here knows about AMP.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

# Questions nested inside one another at most (an expression's values, a function's call sites,
# a re-exported name), and asked under one outermost question at most: bounds on a pathological
# chain, far above what real trees need (diffusers at db21c97, scanned whole: 214 nested, 54,000
# under one question: the first question that enters a large cycle walks all of it, once).
# ``deep_stack`` gives the Python stack this nesting needs.
_MAX_NESTED = 20_000
_MAX_FRAMES = 2_000_000
_MAX_ROUNDS = 6  # a cycle's head asked again at most this often before it is given up as partial


@dataclass(eq=False)
class _Frame:
    """One question being answered: its key, its depth on the stack, the lowest depth a cut
    under it reached (``level + 1``: none), and once answered unfinished, the question it waits
    for (``waits``; None: a limit was reached) and the unfinished answers that wait with it."""

    key: Any
    level: int
    lowest: int
    memo: dict | None = None
    out: Any = None
    waits: "_Frame | None" = None
    deferred: bool = False
    under: list = field(default_factory=list)  # frames answered unfinished under this one


class Questions:
    """The questions being answered right now, across every module of the project, and the
    cycles met under them.

    A question asked while it is being answered (a cycle: ``x = f(x)``, a parameter whose callers
    pass what the function returns, two modules importing each other) gets the answer found so
    far, nothing the first time round. The question at the head of the cycle is then asked again
    with its own last answer until that stops growing (the values only grow), and at that point
    every answer found under it is whole and remembered with it: a large cycle (a package whose
    classes and re-exports all reach each other) is walked a few times in all, not once per
    question that enters it, and what a question gets does not depend on which came first (nor
    on PYTHONHASHSEED). An answer that depends on a question still open above is kept only until
    that one is answered; past the nesting and size limits a question is answered with what is
    known and nothing above it is remembered."""

    def __init__(self) -> None:
        self.on_stack: dict[Any, int] = {}   # question key (an expression's id, ...) -> its level
        self._stack: list[_Frame] = []
        self.partial: dict[Any, _Frame] = {}  # key -> its unfinished answer
        self.provisional: dict[Any, Any] = {}  # a cycle's head -> its answer so far
        self.frames = 0  # questions asked under the current outermost one

    def cut_at(self, level: int) -> None:
        """The current question read an unfinished answer of the one at ``level`` (-1: a limit
        was reached, so nothing above it is whole)."""
        if self._stack:
            top = self._stack[-1]
            if level < top.lowest:
                top.lowest = level

    def answer(self, key: Any, memo: dict, compute: Callable[[], Any], nothing: Any) -> Any:
        """``compute()`` as one question: remembered in ``memo`` once whole (see the class)."""
        if key in memo:
            return memo[key]
        if key in self.on_stack:
            self.cut_at(self.on_stack[key])
            return self.provisional.get(key, nothing)
        if key in self.partial:
            frame = self.partial[key]
            self.cut_at(_waiting_level(frame))
            return frame.out
        if len(self._stack) >= _MAX_NESTED or self._stack and self.frames >= _MAX_FRAMES:
            self.cut_at(-1)  # see _MAX_NESTED and _MAX_FRAMES
            return nothing
        for _ in range(_MAX_ROUNDS):
            frame = self._push(key)
            try:
                out = compute()
            finally:
                self._pop(frame)
            if frame.lowest > frame.level:
                return self._settle(frame, memo, out)
            if frame.lowest < frame.level:
                return self._defer(frame, memo, out)
            if key in self.provisional and _same(self.provisional[key], out):
                del self.provisional[key]
                return self._settle(frame, memo, out)
            self.provisional[key] = out  # the head of a cycle: again, with this answer
            for f in _frames_under(frame):
                self.partial.pop(f.key, None)
        self.provisional.pop(key, None)  # still growing: answered as it is, remembered nowhere
        frame.lowest = -1
        return self._defer(frame, memo, out)

    def _push(self, key: Any) -> _Frame:
        level = len(self._stack)
        self.frames = self.frames + 1 if level else 1
        self.on_stack[key] = level
        frame = _Frame(key, level, level + 1)
        self._stack.append(frame)
        return frame

    def _pop(self, frame: _Frame) -> None:
        self._stack.pop()
        del self.on_stack[frame.key]
        if self._stack:
            self.cut_at(frame.lowest)
        else:
            self.partial.clear()
            self.provisional.clear()

    def _settle(self, frame: _Frame, memo: dict, out: Any) -> Any:
        memo[frame.key] = out
        for f in _frames_under(frame):
            f.memo[f.key] = f.out
            self.partial.pop(f.key, None)
        return out

    def _defer(self, frame: _Frame, memo: dict, out: Any) -> Any:
        """An answer that waits for a question above: it, and what waited for it, now wait
        for that one."""
        if self._stack:
            frame.memo, frame.out, frame.deferred = memo, out, True
            frame.waits = self._stack[frame.lowest] if frame.lowest >= 0 else None
            self._stack[-1].under.append(frame)
            self.partial[frame.key] = frame
        return out


def _waiting_level(frame: _Frame) -> int:
    """The level of the open question an unfinished answer waits for, through the answers it
    waited for that are now unfinished themselves (-1: a limit)."""
    w = frame.waits
    while w is not None and w.deferred:
        w = w.waits
    frame.waits = w  # shortcut for the next read
    return -1 if w is None else w.level


def _frames_under(frame: _Frame) -> list[_Frame]:
    out, todo = [], list(frame.under)
    while todo:
        f = todo.pop()
        out.append(f)
        todo.extend(f.under)
    return out


_STACK_BYTES = 1 << 30      # address space for the thread's stack; only what is used is touched
_RECURSION_LIMIT = 400_000  # about 6 Python frames per nested question, _MAX_NESTED of them, and more


def deep_stack(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a thread with room for ``_MAX_NESTED`` nested questions.

    Following values through a large project nests questions thousands deep (a chain of
    parameters, re-exports and call sites through diffusers is); the main thread's stack and
    Python's default recursion limit of 1,000 would end it in a RecursionError. Exceptions are
    raised in the caller as they were raised."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised in the caller's thread below
            result["error"] = exc

    old_limit, old_size = sys.getrecursionlimit(), threading.stack_size()
    sys.setrecursionlimit(max(old_limit, _RECURSION_LIMIT))
    threading.stack_size(_STACK_BYTES)
    try:
        worker = threading.Thread(target=run, name="amp-values", daemon=True)  # Ctrl-C ends the scan
        worker.start()
    finally:
        threading.stack_size(old_size)
    worker.join()
    sys.setrecursionlimit(old_limit)
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _same(a: Any, b: Any) -> bool:
    """Two answers alike: sets of values by what each value is (values are made afresh each
    time a question is asked), anything else by equality."""
    if isinstance(a, (set, frozenset)) and isinstance(b, (set, frozenset)):
        return {_val_key(v) for v in a} == {_val_key(v) for v in b}
    return a == b


def _val_key(v: Any) -> tuple:
    identity = getattr(v, "identity", None)
    return identity() if callable(identity) else (v,)

