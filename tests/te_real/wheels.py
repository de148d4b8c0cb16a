"""Transformer Engine's published Python, downloaded once and cached (never committed).

The ``transformer-engine`` wheel on PyPI (py3-none-any, about 1 MB) holds all of
``transformer_engine/pytorch/**``, ``common/**`` and ``debug/**`` as Python source; its compiled
parts come in other packages (``transformer-engine-cu12``, ``transformer_engine_torch``), which
are neither needed nor fetched. ``te_root(version, cache)`` unpacks just those folders (and the
dist-info, for TE's ``__version__``) into ``cache/te-<version>/``.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

#: the releases tested: the first with QuantizerRole, a middle one, the newest at writing
TE_VERSIONS = ("2.16.1", "2.18.0", "2.20.2")
_KEEP = ("transformer_engine/__init__.py", "transformer_engine/common/",
         "transformer_engine/pytorch/", "transformer_engine/debug/")
#: pip's words for "the index could not be reached"
OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Network is unreachable",
           "Temporary failure in name resolution", "Name or service not known", "ConnectTimeout",
           "ReadTimeoutError", "Connection refused", "ProxyError", "nodename nor servname")


class Unreachable(RuntimeError):
    """The package index could not be reached (the caller skips)."""


def _wheel(version: str, cache: Path) -> Path:
    pattern = f"transformer_engine-{version}-py3-none-any.whl"
    for w in cache.glob(pattern):
        if zipfile.is_zipfile(w):
            return w
        w.unlink()
    res = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--retries", "1", "--timeout", "30", "--disable-pip-version-check", "-q",
         f"transformer-engine=={version}", "-d", str(cache)],
        capture_output=True, text=True, timeout=300)
    found = [w for w in cache.glob(pattern) if zipfile.is_zipfile(w)]
    if res.returncode == 0 and found:
        return found[0]
    text = res.stdout + res.stderr
    if any(word in text for word in OFFLINE):
        raise Unreachable(f"package index unreachable: cannot download transformer-engine=={version}")
    raise RuntimeError(f"pip download transformer-engine=={version} failed:\n{text[-2000:]}")


def te_root(version: str, cache: Path) -> Path:
    """The unpacked Python of TE ``version`` (downloaded and unpacked on first use)."""
    root = cache / f"te-{version}"
    done = root / ".complete"
    if done.is_file():
        return root
    wheel = _wheel(version, cache)
    tmp = cache / f".te-{version}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(_KEEP) or ".dist-info/" in name:
                z.extract(name, tmp)
    (tmp / ".complete").write_text(version)
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root
