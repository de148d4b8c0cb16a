"""The patch tool on a copy of the installed megatron-core: apply, re-apply, check, revert."""
from __future__ import annotations

import filecmp
import shutil
import subprocess
from pathlib import Path

import pytest

from tensor_capture import patcher
from tensor_capture.patcher import PatchError

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "patches" / "apply_patches.sh"
INSTALLED = patcher.installed_megatron_core().parent.parent
FILES = [fp.rel for fp in patcher.edit_set(INSTALLED)[2]]     # the edit set of 0.16.1


@pytest.fixture()
def tree(tmp_path) -> Path:
    root = tmp_path / "Megatron-LM"
    for rel in patcher.TREE_FILES:       # only the files the tool reads: fast to copy
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(INSTALLED / rel, dst)
    return root


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_apply_reapply_check_revert_through_the_script(tree):
    src = INSTALLED
    assert _run(tree, "--check").returncode == 1
    first = _run(tree)
    assert first.returncode == 0 and "patched:" in first.stdout
    assert (tree / patcher.SAVER_REL).read_bytes() == (REPO / patcher.SAVER_REL).read_bytes()
    again = _run(tree)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    check = _run(tree, "--check")
    assert check.returncode == 0 and check.stdout.count(": patched") == len(FILES) + 1
    assert check.stdout.startswith("megatron-core 0.16.1 (edit set 0.16)")
    for rel in FILES:
        text = (tree / rel).read_text()
        assert text.count(patcher.MARK) >= 2
        compile(text, rel, "exec")                        # still valid Python
    assert _run(tree, "--revert").returncode == 0
    for rel in FILES:
        assert filecmp.cmp(tree / rel, src / rel, shallow=False), rel
    assert not (tree / patcher.SAVER_REL).exists()
    assert "nothing to do" in _run(tree, "--revert").stdout


def test_unknown_tree_and_moved_anchor_fail_clearly(tree, tmp_path):
    bad = _run(tmp_path / "empty-dir-that-is-not-there")
    assert bad.returncode == 2 and "no such directory" in bad.stderr
    (tmp_path / "plain").mkdir()
    bad = _run(tmp_path / "plain")
    assert bad.returncode == 2 and "not a Megatron tree" in bad.stderr
    assert "Traceback" not in bad.stderr
    layers = tree / "megatron/core/tensor_parallel/layers.py"
    before = {rel: (tree / rel).read_bytes() for rel in FILES}
    layers.write_text(layers.read_text().replace("grad_input = grad_output.matmul(weight)",
                                                 "grad_input = torch.matmul(grad_output, weight)"))
    res = _run(tree)
    assert res.returncode == 2 and "layers.py" in res.stderr and "0.16.1" in res.stderr
    assert "grad_input = grad_output.matmul(weight)" in res.stderr and "supported:" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    # nothing was written: not even the files whose anchors were fine
    attn = "megatron/core/transformer/dot_product_attention.py"
    assert (tree / attn).read_bytes() == before[attn]
    assert not (tree / patcher.SAVER_REL).exists()


def test_hand_edited_patched_file_is_reported(tree):
    patcher.apply(tree)
    attn = tree / "megatron/core/transformer/dot_product_attention.py"
    text = attn.read_text().replace("attention_probs = _tensor_saver.attention_probs(self, attention_probs)",
                                    "attention_probs = attention_probs")
    attn.write_text(text)
    assert patcher.check(tree)["megatron/core/transformer/dot_product_attention.py"].startswith("unknown")
    with pytest.raises(PatchError, match="partially patched"):
        patcher.apply(tree)


def test_accepts_the_megatron_core_directory_itself(tree):
    assert patcher.find_tree(tree / "megatron" / "core") == tree.resolve()
    assert patcher.find_tree(tree / "megatron") == tree.resolve()


def test_prepare_patched_megatron_reuses_an_up_to_date_copy(tmp_path):
    work = patcher.prepare_patched_megatron(tmp_path / "w")
    core = work / "megatron" / "core"
    assert (core / "tensor_saver.py").is_file() and not (work / "megatron" / "__init__.py").exists()
    assert all(v == "patched" for v in patcher.check(work).values())
    marker = core / "tensor_parallel" / "layers.py"
    mtime = marker.stat().st_mtime_ns
    assert patcher.prepare_patched_megatron(tmp_path / "w") == work
    assert marker.stat().st_mtime_ns == mtime                 # reused, not rebuilt
    (core / "tensor_saver.py").write_text("# stale\n")
    patcher.prepare_patched_megatron(tmp_path / "w")
    assert "tensor_capture" in (core / "tensor_saver.py").read_text()   # rebuilt when stale
    installed = patcher.installed_megatron_core()
    assert "tensor_saver.py" not in {p.name for p in installed.iterdir()}   # site-packages untouched
