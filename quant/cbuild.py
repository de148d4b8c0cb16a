"""Build a C source into a shared library with the system compiler, once per machine (a cache).

Why: a few CPU kernels (quant.cpu_blocks) are one pass in C where torch takes several; building
them at first use needs no build step at install and no torch headers. The library is named by a
hash of the source, the flags, the compiler and the machine, compiled under a temporary name and
renamed (processes racing each other each see a whole file), in ``$XDG_CACHE_HOME`` (or
~/.cache)/megatron-lowp-tools, else the temporary folder. Every failure is an ImportError
naming what failed; the caller keeps its torch path (same results, slower).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

#: compilers tried after ``$CC``, in order
COMPILERS = ("cc", "gcc", "clang")
CACHE_DIR = "megatron-lowp-tools"


def compiler() -> Optional[list[str]]:
    """The compiler command: ``$CC`` (words, e.g. ``ccache gcc``) when it names a program,
    else the first of cc, gcc, clang on PATH; None when there is none."""
    env = shlex.split(os.environ.get("CC", ""))
    for cmd in ([env] if env else []) + [[name] for name in COMPILERS]:
        found = shutil.which(cmd[0])
        if found:
            return [found, *cmd[1:]]
    return None


def cache_dir() -> Path:
    """Where built libraries are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / CACHE_DIR


def build(name: str, source: str, flags: Sequence[str],
          fallbacks: Sequence[Sequence[str]] = ((),)) -> Path:
    """The library ``name``_<hash>.so of ``source`` built with ``flags`` (then each of
    ``fallbacks``' extra flags in turn until one compiles), compiled unless cached."""
    cc = compiler()
    if cc is None:
        raise ImportError("no C compiler found ($CC, cc, gcc, clang)")
    tag = hashlib.sha256("\0".join([source, *flags, os.path.realpath(cc[0]), *cc[1:],
                                    platform.machine()]).encode()).hexdigest()[:16]
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / CACHE_DIR):
        target = folder / f"{name}_{tag}.so"
        if target.is_file():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return _compile(cc, source, flags, fallbacks, target)
        except PermissionError:
            continue                       # an unwritable cache: the temporary folder
    raise ImportError(f"no writable folder for the compiled {name} kernel ({cache_dir()})")


def _compile(cc: list[str], source: str, flags: Sequence[str],
             fallbacks: Sequence[Sequence[str]], target: Path) -> Path:
    """Compile into a temporary folder beside ``target``, then rename into place."""
    errors = []
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / f"{target.stem}.c"
        src.write_text(source)
        out = Path(tmp) / target.name
        for extra in fallbacks:
            try:
                run = subprocess.run([*cc, *flags, *extra, str(src), "-o", str(out)],
                                     capture_output=True, text=True)
            except OSError as exc:
                raise ImportError(f"{' '.join(cc)} could not run: {exc}") from exc
            if run.returncode == 0:
                os.replace(out, target)
                return target
            errors.append((run.stderr.strip().splitlines() or ["?"])[-1])
    raise ImportError(f"{' '.join(cc)} could not compile {target.name}: {errors[-1]}")
