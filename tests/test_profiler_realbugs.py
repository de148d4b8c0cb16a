"""bench/realcode/bugs.json (real AMP bugs fixed upstream) and tests/profiler_realbugs (one case of
our own per bug class) stay complete and consistent with each other and with the checker's rules."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUGS = REPO / "bench" / "realcode" / "bugs.json"
CASES = Path(__file__).parent / "profiler_realbugs"
_EXPECT = re.compile(r"#\s*(?:expect|missed):\s*(\S+)")
_CAUGHT = re.compile(r"#\s*expect:\s*(AMP\d{3})")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
FIELDS = ("id", "repo", "fix_commit", "parent_commit", "path", "lines", "scan", "bug_class",
          "expect_rule", "description", "reference")


def _bugs() -> list[dict]:
    return json.loads(BUGS.read_text())["bugs"]


def _rule_ids() -> set[str]:
    out = subprocess.run([sys.executable, "-m", "training_profiler.amp_checker.checker", "--list-rules"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _case_file(bug_class: str) -> Path:
    return CASES / (bug_class.replace("-", "_") + ".py")


def _markers(path: Path) -> list[tuple[int, str]]:
    return [(n, m.group(1)) for n, line in enumerate(path.read_text().splitlines(), 1)
            if (m := _EXPECT.search(line))]


HELDOUT = REPO / "bench" / "realcode" / "bugs_heldout.json"
HELDOUT2 = REPO / "bench" / "realcode" / "bugs_heldout2.json"
HELDOUT3 = REPO / "bench" / "realcode" / "bugs_heldout3.json"
HELDOUT4 = REPO / "bench" / "realcode" / "bugs_heldout4.json"


def _fixes(path: Path) -> set[tuple[str, str]]:
    return {(b["repo"], b["fix_commit"]) for b in json.loads(path.read_text())["bugs"]}


@pytest.mark.parametrize("path", [BUGS, HELDOUT, HELDOUT2, HELDOUT3, HELDOUT4],
                         ids=["bugs", "heldout", "heldout2", "heldout3", "heldout4"])
def test_bug_records_are_complete(path: Path) -> None:
    bugs = json.loads(path.read_text())["bugs"]
    rules = _rule_ids()
    assert 15 <= len(bugs) <= 80
    assert len({b["id"] for b in bugs}) == len(bugs)
    earlier = {BUGS: [], HELDOUT: [BUGS], HELDOUT2: [BUGS, HELDOUT], HELDOUT3: [BUGS, HELDOUT, HELDOUT2],
                HELDOUT4: [BUGS, HELDOUT, HELDOUT2, HELDOUT3]}[path]
    for other in earlier:  # chosen apart: no bug of an earlier set again
        assert not _fixes(path) & _fixes(other), other.name
    for b in bugs:
        assert set(b) == set(FIELDS), b["id"]
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", b["repo"]), b["id"]
        assert _HEX40.match(b["fix_commit"]) and _HEX40.match(b["parent_commit"]), b["id"]
        assert b["fix_commit"] != b["parent_commit"], b["id"]
        assert b["lines"] and all(isinstance(n, int) and n > 0 for n in b["lines"]), b["id"]
        assert b["scan"] and all(isinstance(s, str) and s for s in b["scan"]), b["id"]
        assert any(s == "." or b["path"].startswith(s.rstrip("/") + "/") for s in b["scan"]), b["id"]
        assert b["expect_rule"] is None or b["expect_rule"] in rules, b["id"]
        assert b["reference"].startswith(f"https://github.com/{b['repo']}/commit/{b['fix_commit']}"), b["id"]
        assert len(b["description"]) > 60 and "\n" not in b["description"], b["id"]


def test_one_expect_rule_per_class() -> None:
    rules_of = defaultdict(set)
    for b in _bugs():
        rules_of[b["bug_class"]].add(b["expect_rule"])
    assert {c: r for c, r in rules_of.items() if len(r) != 1} == {}


def test_every_class_has_exactly_one_case() -> None:
    classes = {b["bug_class"] for b in _bugs()}
    assert {p.name for p in CASES.glob("*.py")} == {_case_file(c).name for c in classes}


@pytest.mark.parametrize("bug_class", sorted({b["bug_class"] for b in json.loads(BUGS.read_text())["bugs"]}))
def test_case_marks_its_class(bug_class: str) -> None:
    want = next(b["expect_rule"] for b in _bugs() if b["bug_class"] == bug_class) or "none-covers"
    path = _case_file(bug_class)
    source = path.read_text()
    ast.parse(source)
    assert 5 <= len(source.splitlines()) <= 30
    marks = _markers(path)
    assert marks and {m for _, m in marks} == {want}, marks


@pytest.mark.parametrize("case", sorted(CASES.glob("*.py")), ids=lambda p: p.stem)
def test_case_is_caught_where_marked(case: Path) -> None:
    """`# expect: AMPxxx` lines are reported with that rule; `# missed: AMPxxx` marks a class a
    rule should cover but the checker does not catch yet (the reason is in BUGS.md), so a case
    that starts being caught shows up here as well."""
    from training_profiler.amp_checker.checker import check_paths
    found = {(f.line, f.rule_id) for f in check_paths([case]).findings}
    lines = case.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if (m := _CAUGHT.search(line)):
            assert (n, m.group(1)) in found, f"{case.name}:{n} not caught"
        elif "# missed:" in line:
            rule = line.split("# missed:")[1].split()[0]
            assert (n, rule) not in found, f"{case.name}:{n} is caught now: mark it expect"
