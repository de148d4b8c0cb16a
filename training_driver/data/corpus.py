"""The embedded default corpus: real English text built at run time from what Python ships.

Why this source: the default run must train on real text on a fresh machine with nothing
downloaded and no corpus copied into the project. Every CPython carries its reference
documentation (``pydoc_data.topics``: the language reference sections ``help()`` shows, about
460 KB of prose and examples) and the docstrings of its standard library. We split them into
paragraph-sized documents and write them as JSON Lines with a "text" field, the same format a
Wikipedia dump is given in, so the default run exercises the real preprocessing path.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Iterator

from lowp_common import atomic_path
from lowp_common.cli import UserError

# Standard-library modules whose docstrings are long-form English prose (read, never executed
# beyond importing the module itself).
_DOC_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "csv", "dataclasses", "decimal",
    "difflib", "email", "fractions", "functools", "heapq", "http.client", "inspect", "itertools",
    "json", "logging", "os", "pathlib", "pickle", "random", "re", "shutil", "socket",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing",
    "unittest", "urllib.parse", "zipfile",
)
_MIN_DOC_CHARS = 200


def _paragraph_documents(text: str, min_chars: int = _MIN_DOC_CHARS) -> Iterator[str]:
    """Group blank-line-separated paragraphs into documents of at least ``min_chars``."""
    buf: list[str] = []
    size = 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        buf.append(para)
        size += len(para)
        if size >= min_chars:
            yield "\n\n".join(buf)
            buf, size = [], 0
    if buf and size >= min_chars // 4:
        yield "\n\n".join(buf)


def _topic_texts() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for key in sorted(topics):
        yield topics[key]


def _docstring_texts() -> Iterator[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _DOC_MODULES:
            try:
                module = importlib.import_module(name)
            except Exception:
                continue
            doc = inspect.getdoc(module)
            if doc:
                yield doc
            for attr in sorted(vars(module)):
                obj = getattr(module, attr, None)
                if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                    continue
                if inspect.isclass(obj) or inspect.isfunction(obj):
                    doc = inspect.getdoc(obj)
                    if doc and len(doc) >= _MIN_DOC_CHARS:
                        yield doc


def builtin_documents() -> list[str]:
    """Every document of the default corpus, in a fixed order (same Python, same corpus)."""
    docs: list[str] = []
    for source in (_topic_texts(), _docstring_texts()):
        for text in source:
            docs.extend(_paragraph_documents(text))
    return docs


def write_builtin_corpus(path: str | os.PathLike[str], max_chars: int | None = None) -> dict:
    """Write the default corpus as JSON Lines (``{"text": ...}`` per line); returns a summary.

    ``max_chars`` caps the total size (the test suite uses a small slice).
    """
    docs = builtin_documents()
    if max_chars is not None:
        kept, total = [], 0
        for d in docs:
            if total >= max_chars:
                break
            kept.append(d)
            total += len(d)
        docs = kept
    if not docs:
        raise UserError("this Python has neither pydoc_data nor standard-library docstrings to "
                        f"build the default corpus from (Python {sys.version.split()[0]}); pass "
                        "--data with your own corpus")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(p) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    return {"path": str(p), "documents": len(docs), "characters": sum(len(d) for d in docs)}
