"""The patch set on every supported megatron-core release, and the whole-line anchor rule.

The release matrix downloads each tested release's wheel at test time (``pip download --no-deps
--only-binary=:all: --python-version 3.12 megatron-core==V``, cached in pytest's cache), unpacks
the files the patcher reads, and on each: apply, re-apply (nothing to do), --check, compile every
patched file, revert (byte-identical), revert again (nothing to do). It skips with one line only
when the package registry cannot be reached. No Megatron code is kept in this repository.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tensor_capture import patch_edits, patcher
from tensor_capture.patcher import PatchError

RELEASES = [v for fam in patch_edits.FAMILIES for v in fam.tested]
INSTALLED = patcher.installed_megatron_core().parent.parent
# pip's words for "the index could not be reached" (DNS, refused, offline, timeouts).
_OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Network is unreachable",
            "Temporary failure in name resolution", "Name or service not known", "ConnectTimeout",
            "ReadTimeoutError", "Connection refused", "ProxyError", "nodename nor servname")


def _download(version: str, cache: Path) -> tuple[Path | None, str]:
    """(wheel, '') from the cache or pip; (None, pip's output) when pip failed."""
    for w in cache.glob(f"megatron_core-{version}-*.whl"):
        if zipfile.is_zipfile(w):
            return w, ""
        w.unlink()
    res = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--retries", "1", "--timeout", "30", "--disable-pip-version-check",
         "-q", f"megatron-core=={version}", "-d", str(cache)],
        capture_output=True, text=True, timeout=300)
    found = [w for w in cache.glob(f"megatron_core-{version}-*.whl") if zipfile.is_zipfile(w)]
    return (found[0], "") if res.returncode == 0 and found else (None, res.stdout + res.stderr)


@pytest.fixture(scope="module")
def wheels(request) -> dict[str, Path]:
    if getattr(request.config, "cache", None) is not None:
        cache = Path(request.config.cache.mkdir("megatron-core-wheels"))
    else:  # pytest run with -p no:cacheprovider
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron-core-wheels"
        cache.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        got = dict(zip(RELEASES, pool.map(lambda v: _download(v, cache), RELEASES)))
    failed = {v: out for v, (w, out) in got.items() if w is None}
    if failed:
        text = "\n".join(failed.values())
        if any(word in text for word in _OFFLINE):
            pytest.skip("package registry unreachable: cannot download megatron-core wheels "
                        f"({', '.join(failed)}) for the version matrix")
        pytest.fail(f"pip download failed for {', '.join(failed)}:\n{text[-2000:]}")
    return {v: w for v, (w, _) in got.items()}


def _unpack(wheel: Path, dest: Path) -> Path:
    """Only the files the patch set reads: the tree the patcher sees, small and fast."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for rel in patcher.TREE_FILES:
            if rel in names:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_bytes(z.read(rel))
    return dest


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("version", RELEASES)
def test_release_apply_reapply_check_compile_revert(version, wheels, tmp_path, capsys):
    root = _unpack(wheels[version], tmp_path / version)
    before = _snapshot(root)
    detected = patcher.detect(root)
    assert str(detected) == version
    fam = detected.family
    assert fam is not None and version in fam.tested

    changed = patcher.apply(root)
    assert patcher.LAYERS in changed and patcher.SAVER_REL in changed
    assert patcher.apply(root) == []                                     # idempotent
    states = patcher.check(root)
    assert all(s == "patched" for s in states.values()), states
    assert patcher.main([str(root), "--check"]) == 0
    assert capsys.readouterr().out.startswith(f"megatron-core {version} (edit set {fam.name})")
    for fp in fam.patches:
        text = (root / fp.rel).read_text(encoding="utf-8")
        compile(text, fp.rel, "exec", dont_inherit=True)
        # every edit is in, once, as whole lines
        for e in fp.edits:
            assert ("\n" + text).count("\n" + e.patched) == 1, (fp.rel, e.name)

    assert set(patcher.revert(root)) == set(changed)
    assert _snapshot(root) == before                                     # byte-identical
    assert patcher.revert(root) == []
    assert patcher.main([str(root), "--check"]) == 1                     # clean again
    capsys.readouterr()


# --- the whole-line rule and refusals, on the installed 0.16.1 ---------------------------------

@pytest.fixture()
def tree(tmp_path) -> Path:
    root = tmp_path / "Megatron-LM"
    for rel in patcher.TREE_FILES:
        if (INSTALLED / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(INSTALLED / rel, root / rel)
    return root


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new), encoding="utf-8")


def _refused(root: Path, capsys, *needles: str) -> str:
    before = _snapshot(root)
    assert patcher.main([str(root)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    assert _snapshot(root) == before                                     # nothing written
    return err


def test_anchor_at_the_wrong_indentation_is_not_matched(tree, capsys):
    """The unfused wgrad line nested one level deeper (as on main): a substring match would
    patch it with the wrong indentation; the whole-line rule refuses instead."""
    layers = tree / patcher.LAYERS
    _edit(layers, "            grad_weight = grad_output.t().matmul(total_input)\n",
          "            if True:\n                grad_weight = grad_output.t().matmul(total_input)\n")
    compile(layers.read_text(), "layers.py", "exec")                     # the tree itself is fine
    _refused(tree, capsys, str(layers), "grad_weight = grad_output.t().matmul(total_input)",
             "linear.wgrad", "not found as whole lines", "megatron-core 0.16.1",
             patch_edits.supported_text())


def test_line_matching_needs_line_start_and_end():
    block = "    x = f(y)\n"
    assert patcher._line_matches("    x = f(y)\n", block) == [0]
    assert patcher._line_matches("        x = f(y)\n", block) == []       # deeper indentation
    assert patcher._line_matches("a\n    x = f(y)\n", block) == [2]
    assert patcher._line_matches("    x = f(y)  # note\n", block) == []   # not the whole line
    assert patcher._line_matches("    x = f(y)\n    x = f(y)\n", block) == [0, 13]


def test_moved_anchor_writes_nothing(tree, capsys):
    """One anchor gone in one file: no file is written, not even the ones that would patch."""
    sched = tree / patch_edits.SCHEDULES
    _edit(sched, "    return forward_backward_func\n", "    return (forward_backward_func)\n")
    _refused(tree, capsys, str(sched), "'return forward_backward_func'", "schedule.wrap")
    assert not (tree / patcher.SAVER_REL).exists()


def test_ambiguous_anchor_is_refused(tree, capsys):
    sched = tree / patch_edits.SCHEDULES
    sched.write_text(sched.read_text() + "\n\ndef _again(forward_backward_func):\n"
                                          "    return forward_backward_func\n")
    _refused(tree, capsys, str(sched), "found 2 times")


def test_unsupported_version_is_refused_by_detect_and_apply(tree, capsys):
    info = tree / patch_edits.PACKAGE_INFO
    _edit(info, "MINOR = 16\n", "MINOR = 15\n")
    assert patcher.main([str(tree), "--detect"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(info) in err and "0.15.1 is not supported" in err
    assert patch_edits.supported_text() in err
    _refused(tree, capsys, "0.15.1 is not supported")
    with pytest.raises(PatchError, match="not supported"):
        patcher.revert(tree)


def test_detect_prints_the_version(tree, capsys):
    assert patcher.main([str(tree), "--detect"]) == 0
    assert capsys.readouterr().out == "0.16.1\n"
    assert patcher.detect(tree / "megatron" / "core").family.name == "0.16"


def test_edit_that_would_not_compile_is_refused(tree, capsys, monkeypatch):
    """The compile check before writing: an edit set whose result is not Python writes nothing."""
    fam = patch_edits.family_for((0, 16, 1))
    broken = patch_edits.Edit("broken", "    return forward_backward_func\n",
                              "    return forward_backward_func(\n")
    patches = tuple(patch_edits.FilePatch(fp.rel, (broken,)) if fp.rel == patch_edits.SCHEDULES
                    else fp for fp in fam.patches)
    bad = patch_edits.Family("broken", fam.releases, fam.tested, "", patches)
    monkeypatch.setattr(patcher, "family_for", lambda v: bad)
    _refused(tree, capsys, "schedules.py", "would not compile", "line ")


def test_version_table_is_consistent():
    """Every tested release maps to the family listing it; families do not overlap."""
    for fam in patch_edits.FAMILIES:
        for v in fam.tested:
            major, minor, p = map(int, v.split("."))
            assert patch_edits.family_for((major, minor, p)) is fam
    minors = [r[:2] for fam in patch_edits.FAMILIES for r in fam.releases]
    assert len(minors) == len(set(minors))
    assert patch_edits.family_for((0, 16, 0)) is None and patch_edits.family_for((0, 15, 3)) is None


def test_tree_patched_by_an_older_edit_set_is_upgraded_and_reverts(tree, capsys):
    """A tree patched before the fused-wgrad / frozen-weight edits existed (5 of layers.py's edits,
    no schedules.py edit): --check says outdated, apply adds the rest, revert gives the upstream."""
    before = _snapshot(tree)
    fam = patcher.detect(tree).family
    layers_fp = next(fp for fp in fam.patches if fp.rel == patch_edits.LAYERS)
    old = [e for e in layers_fp.edits if not e.name.startswith(("frozen.", "linear.wgrad_fused"))]
    assert 0 < len(old) < len(layers_fp.edits)
    layers = tree / patch_edits.LAYERS
    text, why = patcher._splice(layers.read_text(), [(e.anchor, e.patched, e.name) for e in old])
    assert why is None
    layers.write_text(text)
    assert patcher.check(tree)[patch_edits.LAYERS].startswith("outdated")
    assert patcher.main([str(tree), "--check"]) == 1
    capsys.readouterr()
    assert patch_edits.LAYERS in patcher.apply(tree)
    assert all(s == "patched" for s in patcher.check(tree).values())
    patcher.revert(tree)
    assert _snapshot(tree) == before
