"""No dead code in the packages: vulture (at 60 % confidence) finds nothing unused.

Policy. A name is used when the packages themselves, bench/, examples/ or script/ read it;
the tests do not count: a function only a test calls is dead product code unless the docs name
it as public API (then it goes into tests/dead_code_allowed.py with that reason). Names a
framework calls by name (TE's quantizer interface, nvdlfw-inspect hooks, ast visitors) or data
written out whole (dataclass fields through asdict) are listed there too, each with its reason.
The corpora the checkers read as data (bench/realcode, bench/audit_cases) are not our code.

Fix a failure by deleting the code (and a test that only exercised it), or, when something
outside our code reads it, by adding ``_.name  # reason`` to tests/dead_code_allowed.py.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import vulture

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lowp_common", "quant", "quant_tools", "tensor_capture", "tensor_viz",
            "te_integration", "training_driver", "training_profiler", "attribution",
            "megatron/core/tensor_saver.py")
#: code that legitimately uses the packages (its own unused names are reported too)
USERS = ("bench", "examples", "script")
#: programs the checkers read as data, not code of ours
NOT_OURS = ("bench/realcode", "bench/audit_cases")
MIN_CONFIDENCE = 60
ALLOWED_FILE = ROOT / "tests" / "dead_code_allowed.py"


@functools.lru_cache(maxsize=1)
def _unused() -> tuple:
    v = vulture.Vulture(verbose=False)
    v.scavenge([str(ROOT / p) for p in PACKAGES + USERS],
               exclude=[str(ROOT / p) for p in NOT_OURS])
    return tuple(v.get_unused_code(min_confidence=MIN_CONFIDENCE))


def _allowed() -> dict[str, int]:
    """``_.name`` entries of the allowed list -> line."""
    tree = ast.parse(ALLOWED_FILE.read_text(), str(ALLOWED_FILE))
    return {node.value.attr: node.lineno for node in tree.body
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "_"}


def _where(item) -> str:
    return f"{Path(item.filename).resolve().relative_to(ROOT)}:{item.first_lineno}: {item.message}"


def test_the_scan_reads_the_packages():
    """The scan really covers the packages (a wrong path would make it pass on nothing)."""
    for p in PACKAGES + USERS:
        assert (ROOT / p).exists(), p
    names = {item.name for item in _unused()}
    assert names & set(_allowed()), "the scan found none of the known framework names"


def test_no_unused_code():
    allowed = _allowed()
    dead = [_where(item) for item in _unused() if item.name not in allowed]
    assert not dead, (
        f"{len(dead)} unused name(s) (vulture, {MIN_CONFIDENCE}% confidence); delete them, or add "
        f"`_.name  # reason` to {ALLOWED_FILE.relative_to(ROOT)} when something outside our code "
        "reads them:\n" + "\n".join(dead))


def test_every_allowed_name_is_still_needed():
    """An entry whose name nothing reports as unused any more is stale: remove it."""
    reported = {item.name for item in _unused()}
    stale = [f"{ALLOWED_FILE.name}:{line}: {name}" for name, line in sorted(_allowed().items())
             if name not in reported]
    assert not stale, "allowed but no longer unused (remove the entries):\n" + "\n".join(stale)
