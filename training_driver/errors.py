"""User-facing errors: one clear line and a non-zero exit, never a traceback for a user mistake."""
from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable[..., int])


class UserError(Exception):
    """A mistake the user can fix (bad path, bad argument); the message names the fix."""


EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def cli_entry(prog: str) -> Callable[[F], F]:
    """Wrap a ``main`` so a UserError prints ``prog: error: ...`` and exits 2, Ctrl-C exits 130."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except UserError as exc:
                print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
                return EXIT_USER_ERROR
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr, flush=True)
                return EXIT_INTERRUPTED

        return wrapper  # type: ignore[return-value]

    return decorate
