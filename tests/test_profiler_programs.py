"""Two programs in one scan never vouch for each other (issue 42, item 6).

A scan of a folder that holds several repositories side by side is several programs: scanned
together, a float16 cast of gradients in one repository once made AMP029 (a gradient norm in
the gradients' dtype) sure of itself in three others. Each repository here is a real program
of our own (a marker file at its root, as a checkout has); scanned together, each must get
exactly the findings it gets alone, and the same evidence inside one repository must still
count, so the test fails both ways."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from training_profiler.amp_checker import checker as sc
from training_profiler.amp_checker.context import FileContext
from training_profiler.amp_checker.project import Project, program_root
from training_profiler.amp_checker.rules import Confidence

# a hand-written total gradient norm, in a package whose trainer uses native AMP
NORM = """
import torch


def total_norm(params):
    return torch.norm(torch.stack([torch.norm(p.grad, 2) for p in params]), 2)
"""
TRAINER = """
import torch

from normpkg.norms import total_norm


def step(model, x, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    total_norm(model.parameters())
    scaler.step(optimizer)
    scaler.update()
"""
# another repository's pure-float16 training: its gradients are float16
HALF = """
import torch


def step(model, x, optimizer):
    loss = model(x).float().mean()
    loss.backward()
    for p in model.parameters():
        p.grad.data = p.grad.data.half()
    optimizer.step()
"""
# a model library: nothing trains in it (its default shows MEDIUM findings)
LIBRARY = """
import torch


class Attention(torch.nn.Module):
    def forward(self, scores, mask):
        return scores.masked_fill(mask, -1e9).softmax(-1)
"""


def _write(root: Path, files: dict[str, str], marker: str | None) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    if marker:
        (root / marker).write_text("")
    return root


def _repos(base: Path, marker: str = "pyproject.toml") -> dict[str, Path]:
    return {
        "norms": _write(base / "norms", {"normpkg/__init__.py": "", "normpkg/norms.py": NORM,
                                         "normpkg/trainer.py": TRAINER}, marker),
        "half": _write(base / "half", {"halfpkg/__init__.py": "", "halfpkg/train.py": HALF}, "setup.py"),
        "library": _write(base / "library", {"libpkg/__init__.py": "", "libpkg/attention.py": LIBRARY},
                          ".git"),
    }


def _found(report: sc.Report, root: Path) -> set[tuple[str, int, str, str, str]]:
    return {(Path(f.path).resolve().relative_to(root.resolve()).as_posix(), f.line, f.rule_id,
             f.confidence.name, f.message) for f in report.findings
            if Path(f.path).resolve().is_relative_to(root.resolve())}


@pytest.mark.parametrize("minimum", [None, Confidence.LOW])
def test_each_repository_gets_its_own_findings_in_a_shared_scan(tmp_path, minimum) -> None:
    repos = _repos(tmp_path)
    together = sc.check_paths([tmp_path], min_confidence=minimum)
    for name, root in repos.items():
        alone = sc.check_paths([root], min_confidence=minimum)
        assert _found(together, root) == _found(alone, root), name


def test_another_repository_is_no_evidence_but_the_same_one_is(tmp_path) -> None:
    repos = _repos(tmp_path / "side_by_side")
    report = sc.check_paths([tmp_path / "side_by_side"], min_confidence=Confidence.LOW)
    norm = [f for f in report.findings if f.rule_id == "AMP029"]
    assert norm and all(f.confidence == Confidence.LOW and "half" not in f.message for f in norm)
    # the same float16 cast inside the norms repository is its evidence: HIGH, naming it
    one = _write(tmp_path / "one", {"normpkg/__init__.py": "", "normpkg/norms.py": NORM,
                                    "normpkg/trainer.py": TRAINER, "normpkg/half.py": HALF}, "setup.cfg")
    inside = [f for f in sc.check_paths([one]).findings if f.rule_id == "AMP029"]
    assert inside and all(f.confidence == Confidence.HIGH and "half.py" in f.message for f in inside)
    assert repos


def test_the_library_keeps_its_own_default_beside_a_training_repository(tmp_path) -> None:
    repos = _repos(tmp_path)
    report = sc.check_paths([tmp_path])
    lib = _found(report, repos["library"])
    assert lib and {c for _, _, _, c, _ in lib} == {"MEDIUM"}   # shown as a library's default
    assert report.project_mode and not report.model_library


def test_program_root_is_the_outermost_marked_folder_under_the_scan(tmp_path) -> None:
    repos = _repos(tmp_path)
    (repos["norms"] / "normpkg" / "ext").mkdir()
    (repos["norms"] / "normpkg" / "ext" / "setup.py").write_text("")
    inner = repos["norms"] / "normpkg" / "ext" / "k.py"
    inner.write_text("")
    assert program_root(inner, [tmp_path]) == repos["norms"].resolve()
    assert program_root(inner, [inner.parent]) == inner.parent.resolve()   # the scan starts there
    assert program_root(repos["half"] / "halfpkg" / "train.py", [repos["half"] / "halfpkg"]) \
        == repos["half"].resolve()                                         # nearest above the scan


def test_an_import_never_resolves_into_another_repository(tmp_path) -> None:
    """Both repositories have ``utils.py`` and ``train.py`` doing ``from utils import ...``:
    each ``train`` resolves to its own ``utils``, whichever was parsed first."""
    project = Project(scan_roots=[tmp_path])
    ctxs = {}
    for repo, marker in (("a", "setup.py"), ("b", "pyproject.toml")):
        _write(tmp_path / repo, {"utils.py": "import torch\nDTYPE = torch.float16\n",
                                 "train.py": "from utils import DTYPE\n"}, marker)
        for mod in ("utils", "train"):
            path = tmp_path / repo / f"{mod}.py"
            ctxs[repo, mod] = FileContext(ast.parse(path.read_text()), project, f"{repo}.{mod}", str(path))
    for repo, other in (("a", "b"), ("b", "a")):
        found = project.find_module("utils", ctxs[repo, "train"])
        assert found is ctxs[repo, "utils"] and found is not ctxs[other, "utils"]
