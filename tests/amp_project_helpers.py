"""Small AMP-checker projects written into a temporary folder, and what the checker reports on
them: shared by the bug-kind tests of each pass."""
from __future__ import annotations

import textwrap
from pathlib import Path

from training_profiler.amp_checker import checker as sc

LOW = sc.Confidence.parse("low")


def make_project(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``tmp_path`` holding ``files`` (name -> source, dedented)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, source in files.items():
        (pkg / name).write_text(textwrap.dedent(source))
    return pkg


def found(pkg: Path, rule: str, words: str = "") -> list[tuple[str, int, str]]:
    """(file name, line, confidence) of ``rule``'s findings at every confidence, those whose
    message holds ``words``."""
    return [(Path(f.path).name, f.line, f.confidence.name) for f in sc.check_paths([pkg], min_confidence=LOW).findings
            if f.rule_id == rule and words in f.message]
