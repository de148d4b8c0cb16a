"""README.md's first hour, in README's order, in a fresh clone (issue 40; slow tier).

Why: the README's main job once left a patched megatron-core copy under ``runs/`` that made
the README's next command, the tests, fail; CI was green only because its checkout was clean.
This test clones the repository (what is committed: HEAD) into a temporary folder, reads the
commands of README's "On a fresh machine" section in their order and runs them there: the
install is skipped (this environment is installed), the main job runs as written, and the
tests run as the fast tier (``-m "not slow"``; the whole suite would take a quarter of an hour
and this test is part of it). The fast tier includes tests/test_architecture.py, which must
pass with the main job's outputs in the tree.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FAST_TIER = 'python -m pytest -q tests -m "not slow"'


def first_hour_commands(readme: str) -> list[str]:
    """The shell commands of README's "On a fresh machine" section, in order."""
    section = readme.split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def plan(commands: list[str]) -> list[str]:
    """What this test runs for each README command: installs skipped, any test command run as
    the fast tier (once)."""
    out: list[str] = []
    for cmd in commands:
        if cmd.startswith("pip install") or "pip install" in cmd:
            continue
        if cmd.startswith("python -m pytest"):
            cmd = FAST_TIER
        if cmd not in out:
            out.append(cmd)
    return out


def test_the_readme_section_is_read_in_order() -> None:
    commands = first_hour_commands((REPO / "README.md").read_text(encoding="utf-8"))
    assert commands[0].startswith("pip install")
    assert plan(commands) == ["bash run_wikipedia_tensor_collection.sh", FAST_TIER]


#: set by .ci/run, which follows README's order itself in CI's fresh clone (the main job, then
#: the whole suite in the tree it left): this test would repeat that, four minutes of CI's time
CI_FOLLOWED_README = "LOWP_CI_FOLLOWED_README"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.skipif(os.environ.get(CI_FOLLOWED_README) == "1",
                    reason="CI ran README's commands in README's order in its own fresh clone")
def test_readme_commands_pass_in_a_fresh_clone(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    steps = plan(first_hour_commands((clone / "README.md").read_text(encoding="utf-8")))
    env = dict(os.environ, PYTHONPATH=str(clone), MPLBACKEND="Agg",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("TENSOR_SAVE_DIR", None)
    env.pop("CUSTOM_QUANT_TYPE", None)
    for cmd in steps:
        proc = subprocess.run(["bash", "-c", cmd], cwd=clone, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n" \
                                     f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if cmd.startswith("bash run_wikipedia"):
            # what the main job leaves in the tree, which the tests must not read as source
            assert (clone / "draw" / "index.html").is_file()
            assert any((clone / "runs").rglob("patched_megatron*")) or \
                any((clone / "runs").rglob(".patched_megatron*"))
        else:
            assert re.search(r"\d+ passed", proc.stdout) and " failed" not in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_architecture.py"],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
