"""A command never replaces a result silently (one definition every command uses).

Why: a typo once re-ran an experiment and replaced the precision plan of a longer one, exit 0
(issue 40). The project's convention: a command that would write over a result it wrote
earlier refuses in one line naming ``--force`` (and the option that picks another place),
before any work; an output it cannot write is refused the same way, before any work.

- ``refuse_overwrite(paths, what=, force=, elsewhere=)``: the plain case (a plan, a JSON file,
  a sweep's results).
- ``claim_folder(folder, source, kinds, force=)`` / ``mark_folder(folder, source)``: a folder
  of *derived views* (a report): drawing the same source into the folder again is a refresh
  and goes ahead; a folder holding another source's (or an unknown) report is refused.
- ``check_writable(path, flag)``: the folder a file or folder would go in can be made and
  written.

Standard library only, like the rest of ``lowp_common``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from lowp_common.cli import PathLike, UserError, atomic_write_json

#: the file in a folder of derived views that names what they were drawn from
OWNER_FILE = ".lowp_source.json"


def refuse_overwrite(paths: Iterable[PathLike], *, what: str, force: bool,
                     elsewhere: str = "") -> None:
    """UserError naming the first of ``paths`` that exists, unless ``force``.

    ``what`` says what the file holds ("the precision plan"); ``elsewhere`` names the option
    that writes somewhere else ("--out DIR").
    """
    if force:
        return
    for path in paths:
        if os.path.lexists(path):
            other = f" or {elsewhere}" if elsewhere else ""
            raise UserError(f"{path} holds {what} written earlier; pass --force to replace it"
                            f"{other}")


def _source_of(folder: Path) -> str | None:
    try:
        data = json.loads((folder / OWNER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("source") if isinstance(data, dict) else None


def _key(source: PathLike) -> str:
    return str(Path(source).expanduser().resolve())


def claim_folder(folder: PathLike, source: PathLike, kinds: Iterable[str], *, force: bool,
                 what: str, elsewhere: str) -> None:
    """Refuse to draw ``source`` into ``folder`` when ``folder`` holds a result (any of the
    file names ``kinds``) drawn from something else, or from an unknown source; unless
    ``force``. The same source again is a refresh of a derived view: allowed."""
    out = Path(folder)
    if force or not out.is_dir():
        return
    present = [k for k in kinds if (out / k).exists()]
    if not present:
        return
    earlier = _source_of(out)
    if earlier == _key(source):
        return
    drawn = f"drawn from {earlier}" if earlier else "of an unknown source"
    raise UserError(f"{out} holds {what} {drawn} ({present[0]}); pass --force to replace it "
                    f"or {elsewhere}")


def mark_folder(folder: PathLike, source: PathLike) -> None:
    """Record what the derived views in ``folder`` were drawn from (see ``claim_folder``)."""
    out = Path(folder)
    if out.is_dir():
        atomic_write_json(out / OWNER_FILE, {"source": _key(source)})


def check_writable(path: PathLike, flag: str, *, folder: bool = False) -> None:
    """UserError when ``path`` (a file, or a folder with ``folder=True``) cannot be written:
    it is the wrong kind, or the nearest existing folder above it is a file or not writable."""
    target = Path(path)
    if target.exists() and target.is_dir() != folder:
        kind = "a folder" if target.is_dir() else "a file"
        raise UserError(f"{flag} {path}: is {kind}; give {'a folder' if folder else 'a file name'}")
    parent = target if folder and target.exists() else target.parent
    parent = parent if str(parent) else Path(".")
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is a file, not a folder; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {parent} is not writable; choose another path")
