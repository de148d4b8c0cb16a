"""The exit-code convention as a user meets it: installed console scripts and the seeds' script
paths run as processes (slow tier: ``multiprocess``). tests/test_cli_conventions.py covers every
mistake of every command in-process; here each command's misspelt option, the script paths'
missing and corrupt inputs, and a closed stdout (``cmd | head -1``).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_conventions import MISTAKES, console_scripts

REPO = Path(__file__).resolve().parent.parent


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert (proc.returncode, len(lines)) == (2, 1), (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and ": error: " in lines[0]
    return lines[0]


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_an_installed_command_refuses_an_abbreviated_option(name: str, tmp_path: Path) -> None:
    exe = shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed (pip install -e .)")
    argv = [a.format(missing=tmp_path / "missing", missing_pt=tmp_path / "missing.pt",
                     tmp=tmp_path, tensor=tmp_path / "t.pt", corrupt_yaml=tmp_path / "c.yaml",
                     corrupt_jsonl=tmp_path / "c.jsonl")
            for a in MISTAKES[name]["flag"]]
    assert name in console_scripts()
    line = one_error_line(run([exe, *argv], tmp_path))
    assert line.startswith(f"{name}: error: ")


SCALING = [sys.executable, str(REPO / "quant" / "mxfp_scaling_test.py")]
ONE_CLICK = ["bash", str(REPO / "script" / "one_click_visualize.sh")]


@pytest.mark.parametrize("argv,needle", [
    (SCALING + ["t.pt", "--elem-format", "fp9"], "--elem-format"),
    (SCALING + ["t.pt", "--no-plot"], "did you mean --no-plots?"),
    (SCALING + ["t.pt", "--output-dir", "a_file/out"], "a_file is a file, not a folder"),
    (ONE_CLICK + ["cap", "out", "--whatif", "fp9"], "--whatif='fp9' is not a known format"),
    (ONE_CLICK + ["cap", "out", "--sample", "5"], "unrecognized arguments: --sample"),
    (ONE_CLICK + ["cap", "a_file/out"], "a_file is a file, not a folder"),
], ids=["scaling-unknown", "scaling-flag", "scaling-unwritable", "one-click-unknown",
        "one-click-flag", "one-click-unwritable"])
def test_the_seed_script_paths_refuse_mistakes_in_one_line(argv: list[str], needle: str,
                                                           tmp_path: Path) -> None:
    import torch

    torch.save(torch.randn(8, 8), tmp_path / "t.pt")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "cap").mkdir()
    assert needle in one_error_line(run(argv, tmp_path))


def test_the_seed_script_paths_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "corrupt.pt").write_bytes(b"garbage" * 10)
    proc = run([sys.executable, str(REPO / "quant" / "mxfp_scaling_test.py"), "corrupt.pt"],
               tmp_path)
    assert "not a PyTorch tensor file" in one_error_line(proc)
    assert "FINAL SUMMARY" not in proc.stdout          # no banner before the error
    proc = run([sys.executable, str(REPO / "quant" / "mxfp_scaling_test.py"), "missing.pt"],
               tmp_path)
    assert "missing.pt: no such file" in one_error_line(proc)
    script = str(REPO / "script" / "one_click_visualize.sh")
    assert "TENSOR_DIR" in one_error_line(run(["bash", script], tmp_path))
    assert "missing" in one_error_line(run(["bash", script, "missing", "out"], tmp_path))
    line = one_error_line(run(["bash", str(REPO / "run_wikipedia_tensor_collection.sh"),
                               "--time", "5"], tmp_path))
    assert "--time" in line


@pytest.mark.parametrize("cmd", [["amp-static-check", "--list-rules"], ["quant-demo"]])
def test_a_closed_stdout_is_a_quiet_exit(cmd: list[str], tmp_path: Path) -> None:
    exe = shutil.which(cmd[0])
    if exe is None:
        pytest.skip(f"{cmd[0]} is not installed (pip install -e .)")
    # the reader is gone before the command writes (as after head -1 took its line)
    proc = subprocess.run(f"'{exe}' {' '.join(cmd[1:])} | true; "
                          "echo \"status ${PIPESTATUS[0]}\" >&2", shell=True, cwd=tmp_path,
                          executable="bash", capture_output=True, text=True, timeout=300)
    assert proc.stderr == "status 0\n"
