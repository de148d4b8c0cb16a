"""Console-command plumbing shared by every command of the project (one definition each).

- ``UserError`` + ``cli_entry(prog)``: a mistake the user can fix is one line
  ``prog: error: ...`` on stderr and exit status 2, never a traceback; Ctrl-C exits 130, even
  when the command was started with SIGINT ignored (``honour_ctrl_c``).
- ``atomic_write_text`` / ``atomic_write_bytes`` / ``atomic_write_json`` / ``atomic_path``:
  write a temporary name in the target's directory, then ``os.replace`` it over the target,
  so readers see the old file or the new one, never half of one.
- ``CommandParser``: every command's ``argparse`` parser: no abbreviated options (a typo
  ``--step`` must not run as ``--steps``) and a mistake is one line, not usage plus a line.
- ``json_safe`` / ``json_dumps``: JSON has no NaN or Infinity and no numpy/torch scalars;
  convert them in one place so every report stays valid JSON.

This module imports only the standard library (numpy and torch objects are recognised by
duck typing), so every package of the project may import it.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import itertools
import json
import math
import os
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, TypeVar

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130

F = TypeVar("F", bound=Callable[..., Any])
PathLike = str | os.PathLike


class UserError(Exception):
    """A mistake the user can fix (bad path, bad argument); the message names the fix."""


#: The same class under the name argparse users expect; ``except UserError`` catches both.
UsageError = UserError


def fail(message: str, prog: str | None = None, code: int = EXIT_USER_ERROR) -> int:
    """Print ``prog: error: message`` as one line on stderr and return ``code`` (for ``return``)."""
    line = " ".join(str(message).split("\n"))
    print(f"{prog}: error: {line}" if prog else f"error: {line}", file=sys.stderr, flush=True)
    return code


@contextlib.contextmanager
def honour_ctrl_c() -> Iterator[None]:
    """Make SIGINT raise KeyboardInterrupt for the duration, also when it arrived ignored.

    Why: a process started in the background of a non-interactive shell (``cmd &`` in a
    script, a test runner started so, ``nohup ... &`` from a script) inherits SIGINT as
    *ignored*, and Python then installs no KeyboardInterrupt handler; every child inherits the
    same, so ``kill -INT`` / Ctrl-C on the group does nothing and a training run goes on to its
    end. Restores the previous disposition afterwards (a test runner calling ``main`` keeps its own).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])   # same story
    if blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        if previous is signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous)


def cli_entry(prog: str, user_errors: tuple[type[BaseException], ...] = ()) -> Callable[[F], F]:
    """Wrap a console ``main`` so user mistakes exit 2 with one line and Ctrl-C exits 130.

    ``UserError`` is always a user mistake; ``user_errors`` adds library exception types
    (e.g. a config parser's ``ValueError`` subclass) that the command treats the same way.
    Anything else is a bug in the tool and keeps its traceback. SIGINT is honoured even when
    inherited as ignored (``honour_ctrl_c``).
    """
    caught = (UserError, *user_errors)

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                with honour_ctrl_c():
                    code = func(*args, **kwargs)
                    sys.stdout.flush()        # a closed pipe shows here, not at exit
                    return code
            except caught as exc:
                return fail(str(exc), prog)
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr, flush=True)
                return EXIT_INTERRUPTED
            except BrokenPipeError:
                return quiet_closed_stdout()

        return wrapper

    return decorate


def quiet_closed_stdout() -> int:
    """The reader of stdout went away (``cmd | head -1``): exit 0 without a word.

    Why: the reader got what it wanted; a traceback, or the interpreter's own "Exception
    ignored ... BrokenPipeError" (or a native library's abort when it flushes at exit, as
    pyarrow / DuckDB's nanobind did: "terminate called after throwing ...") is noise. Pointing
    stdout at /dev/null makes every later flush succeed.
    """
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` names a default only where it says something: not for on/off flags (a
    ``--no-verify`` reading "(default: True)" misleads) and not for an unset ``None``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """The argument parser of every command of the project (one definition).

    Why: argparse takes ``--step 10`` for ``--steps 10`` by default; a typo then runs a
    different experiment and replaces a result (issue 40), so abbreviations are off
    (``allow_abbrev=False``, also for sub-commands, which get this class). A mistake is one
    line ``prog: error: ...`` (with the option meant, when a misspelt one is close) and exit 2,
    as every other user error of the project; ``--help`` shows the usage.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:    # argparse's signature: NoReturn
        hint = self._close_option(message)
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {' '.join(message.split())}{hint}"
                  f" (see {self.prog} --help)\n")

    def _close_option(self, message: str) -> str:
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for word in message.split(":", 1)[1].split():
            if word.startswith("--"):
                near = difflib.get_close_matches(word.split("=")[0], known, n=1, cutoff=0.75)
                if near:
                    return f"; did you mean {near[0]}?"
        return ""


# --------------------------------------------------------------------------------------
# atomic writes


_TEMP_COUNTER = itertools.count()


def _temp_name(path: Path) -> Path:
    """A hidden sibling, unique per process and call, that does NOT end in the target's suffix:
    a reader globbing ``*.pt`` / ``*.png`` never sees a half-written file."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}_{next(_TEMP_COUNTER)}")


@contextlib.contextmanager
def atomic_path(path: PathLike, *, make_parents: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success rename it over ``path``.

    An existing ``path`` keeps its permission bits. For writers that take a file name: ``torch.save(obj, tmp)``, ``fig.savefig(tmp, format="png")``
    (the temporary name has no ``.png``, so name the format). On an exception the temporary file
    is removed and ``path`` keeps its old content.
    """
    final = Path(path)
    if make_parents:
        final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(final)
    try:
        yield tmp
        with contextlib.suppress(FileNotFoundError):  # replacing a file keeps its permissions
            os.chmod(tmp, stat.S_IMODE(os.stat(final).st_mode))
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_bytes(path: PathLike, data: bytes, *, make_parents: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_path(path, make_parents=make_parents) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: PathLike, text: str, *, encoding: str = "utf-8",
                      make_parents: bool = False) -> Path:
    """Write ``text`` to ``path`` atomically (newlines as given); returns the path."""
    with atomic_path(path, make_parents=make_parents) as tmp:
        with open(tmp, "w", encoding=encoding, newline="") as fh:
            fh.write(text)
    return Path(path)


def atomic_write_json(path: PathLike, obj: Any, *, indent: int | None = 2,
                      nonfinite: Literal["string", "null"] = "string",
                      make_parents: bool = False, **dumps_kwargs: Any) -> Path:
    """``json_dumps(obj)`` plus a final newline, written atomically; returns the path."""
    text = json_dumps(obj, indent=indent, nonfinite=nonfinite, **dumps_kwargs) + "\n"
    return atomic_write_text(path, text, make_parents=make_parents)


@contextlib.contextmanager
def staged_dir(final: PathLike) -> Iterator[Path]:
    """Yield an empty hidden directory inside ``final`` for a run's outputs; on success move
    every file in it into ``final`` (``os.replace`` each: readers see an old file or the new
    one), on an exception remove it, and ``final`` and its parents too when this call created
    them and they are empty: a failed run leaves nothing behind, a successful one replaces
    only the files it wrote."""
    import shutil
    import tempfile

    final = Path(final)
    created = [d for d in (final, *final.parents) if not d.exists()]
    final.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".partial-", dir=final))
    try:
        yield stage
        for src in sorted(p for p in stage.rglob("*") if p.is_file()):
            dst = final / src.relative_to(stage)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
        shutil.rmtree(stage, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for d in sorted(created, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()            # only when empty
        raise


# --------------------------------------------------------------------------------------
# JSON-safe numbers


def _float(value: float, nonfinite: str) -> float | str | None:
    if math.isfinite(value):
        return value
    return str(value) if nonfinite == "string" else None


def json_safe(obj: Any, nonfinite: Literal["string", "null"] = "string") -> Any:
    """A copy of ``obj`` that ``json.dumps(..., allow_nan=False)`` accepts.

    NaN/Inf become ``"nan"``/``"inf"``/``"-inf"`` (``nonfinite="string"``, the project's
    reports) or ``None``; numpy and torch scalars and 0-d arrays become Python numbers, arrays
    and tensors become (nested) lists; dict keys become strings; paths become strings.
    """
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return int(obj)  # int subclasses (IntEnum, numpy's on some builds) as plain int
    if isinstance(obj, float):
        return _float(float(obj), nonfinite)
    if isinstance(obj, dict):
        return {str(k): json_safe(v, nonfinite) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [json_safe(v, nonfinite) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    tolist = getattr(obj, "tolist", None)  # numpy arrays/scalars, torch tensors
    if callable(tolist):
        return json_safe(tolist(), nonfinite)
    item = getattr(obj, "item", None)
    if callable(item):
        return json_safe(item(), nonfinite)
    return obj


def json_dumps(obj: Any, *, nonfinite: Literal["string", "null"] = "string", **kwargs: Any) -> str:
    """``json.dumps`` of ``json_safe(obj)``; always strict JSON (``allow_nan=False``)."""
    return json.dumps(json_safe(obj, nonfinite), allow_nan=False, **kwargs)


def human_bytes(n: float) -> str:
    """A byte count for people, in decimal units (kB, MB, GB, TB) as capture settings are
    written ("byte_budget: 10kB"); infinity reads "unlimited"."""
    if n == math.inf:
        return "unlimited"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
