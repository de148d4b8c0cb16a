"""lowp_common.cli: one-line user errors with exit 2, atomic writes, JSON-safe numbers."""
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from lowp_common import (
    EXIT_INTERRUPTED,
    UsageError,
    UserError,
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    cli_entry,
    json_dumps,
    json_safe,
)


def test_user_error_is_one_line_and_exit_2(capsys):
    @cli_entry("tool")
    def main() -> int:
        raise UserError("--input x.pt: no such file; pass a captured tensor")

    assert main() == 2
    err = capsys.readouterr().err
    assert err == "tool: error: --input x.pt: no such file; pass a captured tensor\n"


def test_usage_error_alias_and_extra_user_error_types(capsys):
    class ConfigError(ValueError):
        pass

    @cli_entry("tool", user_errors=(ConfigError,))
    def main(kind: str) -> int:
        raise {"usage": UsageError("bad flag"), "config": ConfigError("bad yaml\nsecond line")}[kind]

    assert main("usage") == 2
    assert main("config") == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["tool: error: bad flag", "tool: error: bad yaml second line"]


def test_bug_keeps_its_traceback_and_ctrl_c_is_130(capsys):
    @cli_entry("tool")
    def buggy() -> int:
        raise ZeroDivisionError("a bug")

    @cli_entry("tool")
    def interrupted() -> int:
        raise KeyboardInterrupt

    with pytest.raises(ZeroDivisionError):
        buggy()
    assert interrupted() == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "tool: interrupted\n"


def test_process_exit_status_and_no_traceback(tmp_path):
    script = tmp_path / "cmd.py"
    script.write_text(textwrap.dedent("""
        import sys
        from lowp_common import UserError, cli_entry

        @cli_entry("cmd")
        def main():
            raise UserError("missing.pt: no such file")

        sys.exit(main())
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert r.returncode == 2
    assert r.stderr == "cmd: error: missing.pt: no such file\n"
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("when", ["while printing", "at the last flush"])
def test_a_closed_stdout_is_a_quiet_exit(tmp_path, when):
    """``cmd | head -1``: the reader is gone; exit 0 with nothing on stderr (no traceback, no
    "Exception ignored ... BrokenPipeError" from the interpreter's own flush at exit)."""
    lines = 200_000 if when == "while printing" else 40
    script = tmp_path / "cmd.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from lowp_common import cli_entry

        @cli_entry("cmd")
        def main():
            print("row 0", flush=True)
            time.sleep(1)             # the reader takes its line and goes
            for i in range(1, {lines}):
                print("row", i)       # a pipe's worth fails here; a few lines at the exit flush
            return 0

        sys.exit(main())
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline() == b"row 0\n"
    proc.stdout.close()                     # what head -1 does after its line
    err = proc.stderr.read().decode()
    assert (proc.wait(), err) == (0, "")


@pytest.mark.parametrize("inherited", ["ignored", "blocked"])
def test_ctrl_c_is_honoured_when_inherited_ignored_or_blocked(tmp_path, inherited):
    """A command started in the background of a script inherits SIGINT ignored, and
    Python then never raises KeyboardInterrupt: Ctrl-C was lost. cli_entry turns it back on
    (and unblocks it) for the command's run; the caller's setting is back afterwards."""
    import signal

    script = tmp_path / "cmd.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        from lowp_common import cli_entry

        @cli_entry("cmd")
        def main():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)          # only reached when the SIGINT was lost
            return 0

        code = main()
        print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
              signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        sys.exit(code)
    """))

    def inherit():
        if inherited == "ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                       preexec_fn=inherit, timeout=60)
    assert r.returncode == EXIT_INTERRUPTED, r.stderr
    assert r.stderr == "cmd: interrupted\n"
    assert r.stdout.split() == (["True", "False"] if inherited == "ignored" else ["False", "True"])


def test_atomic_writes_replace_and_leave_no_temp(tmp_path):
    p = tmp_path / "out.txt"
    p.write_text("old")
    atomic_write_text(p, "new\r\nline")
    assert p.read_bytes() == b"new\r\nline"
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    atomic_write_json(tmp_path / "sub" / "r.json", {"x": float("nan")}, make_parents=True)
    assert json.loads((tmp_path / "sub" / "r.json").read_text()) == {"x": "nan"}
    assert sorted(f.name for f in tmp_path.iterdir()) == ["b.bin", "out.txt", "sub"]


def test_atomic_path_keeps_old_file_on_failure_and_hides_the_temp(tmp_path):
    p = tmp_path / "fig.png"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            assert tmp.parent == p.parent and tmp.name.startswith(".") and not tmp.name.endswith(".png")
            tmp.write_bytes(b"half")
            raise RuntimeError("writer crashed")
    assert p.read_bytes() == b"old"
    assert [f.name for f in tmp_path.iterdir()] == ["fig.png"]
    with atomic_path(tmp_path / "t.pt") as tmp:
        torch.save({"a": torch.ones(2)}, tmp)
        assert list(tmp_path.glob("*.pt")) == []        # a reader never sees the half-written file
    assert torch.equal(torch.load(tmp_path / "t.pt", weights_only=True)["a"], torch.ones(2))
    with atomic_path(p) as a, atomic_path(p) as b:
        assert a != b                                   # two writers never share a temporary name
        a.write_bytes(b"a")
        b.write_bytes(b"b")
    assert p.read_bytes() == b"a"                       # the last rename wins, whole
    p.chmod(0o755)
    atomic_write_bytes(p, b"new")
    assert p.stat().st_mode & 0o777 == 0o755            # a replaced file keeps its mode


def test_json_safe_numbers():
    obj = {"nan": float("nan"), "inf": math.inf, "ninf": -math.inf, "np32": np.float32(0.5),
           "np64": np.float64(np.nan), "i": np.int64(7), "b": np.bool_(True), "t": torch.tensor(3.0),
           "tn": torch.tensor([1.0, float("inf")]), "arr": np.array([[1, 2]]), 5: (1, 2.5),
           "path": __import__("pathlib").Path("a/b")}
    out = json.loads(json_dumps(obj))
    assert out == {"nan": "nan", "inf": "inf", "ninf": "-inf", "np32": 0.5, "np64": "nan", "i": 7,
                   "b": True, "t": 3.0, "tn": [1.0, "inf"], "arr": [[1, 2]], "5": [1, 2.5],
                   "path": os.path.join("a", "b")}
    assert type(out["i"]) is int and type(out["b"]) is bool
    assert json_safe([float("nan"), np.float32("inf")], nonfinite="null") == [None, None]
    with pytest.raises(ValueError):  # the raw object is not strict JSON: the helper is needed
        json.dumps(obj["nan"], allow_nan=False)


REPO = __import__("pathlib").Path(__file__).resolve().parent.parent
PACKAGES = ("lowp_common", "quant", "quant_tools", "tensor_capture", "tensor_viz", "training_driver",
            "training_profiler")
#: os.replace that is not a copy of atomic_path: "file": reason.
OTHER_RENAMES = {
    "tensor_capture/patcher.py": "swaps a whole patched megatron/core directory into place",
    "quant/accel.py": "a compile failure's traceback file; quant is the numerics layer and "
                      "imports nothing of the project, lowp_common included",
    "quant/cbuild.py": "a compiled kernel library renamed into place (quant imports nothing of "
                       "the project, lowp_common included); the recorder's kernel builds here too",
}


def test_lowp_common_is_the_bottom_layer():
    """It imports nothing of the project, so every package may import it (quant does not)."""
    import ast

    for path in (REPO / "lowp_common").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                assert name.split(".")[0] not in PACKAGES[1:], f"{path.name} imports {name}"


def test_no_other_copies_of_the_atomic_write():
    """Every file write that renames goes through lowp_common (a listed exception says why)."""
    found = []
    for pkg in PACKAGES[1:]:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if "os.replace(" in path.read_text(encoding="utf-8") and rel not in OTHER_RENAMES:
                found.append(rel)
    assert found == [], f"use lowp_common.atomic_path / atomic_write_* in {found}"


def test_staged_dir_publishes_on_success_and_leaves_nothing_on_failure(tmp_path):
    from lowp_common import staged_dir

    out = tmp_path / "a" / "b"
    with staged_dir(out) as stage:
        (stage / "r.txt").write_text("new")
        (stage / "sub").mkdir()
        (stage / "sub" / "p.png").write_bytes(b"png")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == \
        ["r.txt", "sub", "sub/p.png"]
    with pytest.raises(RuntimeError):                      # existing folder: old files kept
        with staged_dir(out) as stage:
            (stage / "r.txt").write_text("half")
            raise RuntimeError("sweep failed")
    assert (out / "r.txt").read_text() == "new" and not list(out.glob(".partial-*"))
    fresh = tmp_path / "x" / "y" / "z"
    with pytest.raises(KeyboardInterrupt):                 # created folders are removed again
        with staged_dir(fresh) as stage:
            (stage / "log").write_text("started")
            raise KeyboardInterrupt
    assert not (tmp_path / "x").exists()
