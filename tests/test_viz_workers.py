"""The report's worker processes: no deadlock with torch's thread pool, every wait bounded,
no worker left behind (tensor_viz.workers)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from viz_helpers import make_capture

from tensor_viz import pipeline, workers

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _descendants(pid: int) -> set[int]:
    """Live (not zombie) processes below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(entry))
    return alive


def _wait_gone(pgid: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := _group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), QUANT_COMPILE="0")


def test_a_stuck_task_is_stopped_and_the_others_finish():
    """One task never returns: it comes back as Failed after the timeout, its worker is killed,
    the other tasks still run (on a fresh worker)."""
    before = _descendants(os.getpid())     # other tests' children (a Spark JVM, say) stay
    start = time.monotonic()
    with workers.Pool(2) as pool:
        got = dict(pool.imap(time.sleep, [0.0, 3600.0, 0.0, 0.0, 0.0], timeout=3.0))
    elapsed = time.monotonic() - start
    assert isinstance(got.pop(1), workers.Failed)
    assert got == {0: None, 2: None, 3: None, 4: None}
    assert elapsed < 60
    assert not _descendants(os.getpid()) - _forkservers() - before, "a worker outlived the pool"


def _forkservers() -> set[int]:
    """The forkserver and resource tracker: children multiprocessing keeps for reuse."""
    from multiprocessing import forkserver, resource_tracker

    pids = (forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid)
    return {p for p in pids if p}


def test_workers_do_not_deadlock_after_torch_ran_in_parallel_here():
    """The hang of a forked worker: this process ran a parallel torch op (OpenMP's pool is up);
    a fork of it would wait forever in its first parallel op. Pool workers run them."""
    torch.set_num_threads(2)
    try:
        torch.special.ndtr(torch.randn(1 << 20))           # starts the intra-op thread pool
        x = torch.randn(1 << 20, dtype=torch.float64)
        with workers.Pool(2, threads=2) as pool:
            got = dict(pool.imap(torch.special.ndtr, [x, x], timeout=60.0))
    finally:
        torch.set_num_threads(1)
    assert not any(isinstance(v, workers.Failed) for v in got.values()), got
    assert torch.equal(got[0], torch.special.ndtr(x))


def test_a_stuck_section_is_one_line_and_the_report_completes(tmp_path, capsys, monkeypatch):
    import stuck_section

    make_capture(tmp_path / "cap", quant_types=("hifp8", "bf16"), iterations=(0,), layers=(0,))
    monkeypatch.setattr(pipeline, "_draw_section", stuck_section.draw_or_hang)
    opts = pipeline.Options(workers=2, progress=False, whatif=(), worker_timeout=20.0)
    sections = ("statistics", stuck_section.STUCK, "distributions")
    before = _descendants(os.getpid())
    start = time.monotonic()
    result = pipeline.build(tmp_path / "cap", tmp_path / "out", sections, opts)
    assert time.monotonic() - start < 120
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"section {stuck_section.STUCK} not drawn" in lines[0], lines
    drawn = {f.section for f in result.figures.figures if not f.placeholder}
    assert {"statistics", "distributions"} <= drawn and stuck_section.STUCK not in drawn
    assert "this section was not drawn" in (tmp_path / "out" / "index.html").read_text()
    assert not _descendants(os.getpid()) - _forkservers() - before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_no_worker_outlives_an_interrupted_report(tmp_path, sig):
    """The report command is stopped while a worker is stuck in a section (Ctrl-C, timeout's
    SIGTERM, SIGKILL): every process it started is gone within seconds."""
    make_capture(tmp_path / "cap", quant_types=("hifp8", "bf16"), iterations=(0,), layers=(0,))
    cmd = [sys.executable, str(TESTS / "stuck_section.py"), "--tensor_dir", str(tmp_path / "cap"),
           "--output_dir", str(tmp_path / "out"), "--workers", "2", "--whatif", "none"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list((tmp_path / "out").rglob("*.png")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        time.sleep(3.0)                        # drawing: one worker is stuck in its section
        assert proc.poll() is None and len(_group_alive(proc.pid)) >= 3, "no workers ran"
        os.kill(proc.pid, sig)
        proc.wait(timeout=60)
        left = _wait_gone(proc.pid, 15)
        assert not left, f"processes left after {sig.name}: {left}"
        if sig is signal.SIGINT:
            assert proc.returncode == 130
        elif sig is signal.SIGTERM:
            assert proc.returncode == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _group_alive(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_report_of_a_2000_file_1gib_capture_in_two_minutes():
    """The capture that hung the one-click report (5 iterations x 16 layers x 3 quant types,
    2,160 files, 1.07 GiB through TensorSaver.save_tensor) renders with 2 workers in 2 minutes."""
    from big_capture import FILE_BYTES, write_big_capture

    tmp = Path(tempfile.mkdtemp(prefix="viz_big_"))
    proc = None
    try:
        t0 = time.monotonic()
        files = write_big_capture(tmp / "cap")
        generated = time.monotonic() - t0
        size = sum(p.stat().st_size for p in (tmp / "cap").iterdir())
        assert files >= 2000 and size >= 1 << 30 and files * FILE_BYTES <= size
        cmd = ["bash", str(ROOT / "script" / "one_click_visualize.sh"), str(tmp / "cap"),
               str(tmp / "out"), "--workers", "2", "--no-progress"]
        t1 = time.monotonic()
        proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the report did not finish in 120 s (generation took {generated:.0f} s)")
        rendered = time.monotonic() - t1
        print(f"generated {files} files / {size / 2**30:.2f} GiB in {generated:.1f} s; "
              f"report in {rendered:.1f} s")
        assert proc.returncode == 0, out[-3000:]
        assert "not drawn" not in out, out[-3000:]
        assert (tmp / "out" / "index.html").is_file()
        assert len(list((tmp / "out").rglob("*.png"))) >= 30
        assert not _wait_gone(proc.pid, 10), "a worker outlived the report"
    finally:
        if proc is not None:
            for pid in _group_alive(proc.pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
