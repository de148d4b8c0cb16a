"""Every SLOW_TIERS pattern must still name a test: a renamed test would otherwise drop out of
its tier silently and run (or be skipped) where nobody expects it."""
import ast
import fnmatch
import pathlib

import pytest
from conftest import SLOW_TIERS, TIER_MARKERS

TESTS = pathlib.Path(__file__).parent


def _names_in(module: pathlib.Path) -> set[str]:
    """Test functions, fixtures and the parameter names of tests (fixtures used) of one module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            if node.name.startswith("test_"):
                names.update(a.arg for a in node.args.args)
    return names


@pytest.mark.parametrize("pattern", sorted(SLOW_TIERS))
def test_slow_tier_pattern_names_a_test(pattern: str) -> None:
    module_pattern, _, name_pattern = pattern.partition("::")
    modules = [p for p in TESTS.glob("test_*.py") if fnmatch.fnmatchcase(p.name, module_pattern)]
    assert modules, f"SLOW_TIERS pattern {pattern!r}: no test module matches {module_pattern!r}"
    if not name_pattern:
        return
    hits = [n for m in modules for n in _names_in(m) if fnmatch.fnmatchcase(n, name_pattern)]
    assert hits, f"SLOW_TIERS pattern {pattern!r}: no test or fixture matches {name_pattern!r}"


def test_slow_tiers_name_known_markers() -> None:
    unknown = {t for tiers in SLOW_TIERS.values() for t in tiers} - set(TIER_MARKERS)
    assert not unknown, f"SLOW_TIERS names markers not in TIER_MARKERS: {sorted(unknown)}"
