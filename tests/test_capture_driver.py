"""llama-train numbers captured iterations through tensor_saver.wrap_schedule, like pretrain_gpt.py.

Subprocesses on a patched megatron-core copy: a run, its resumed continuation, and a byte budget
that cannot hold one iteration.
"""
from __future__ import annotations

import sys
from collections import Counter

import pytest
from training_helpers import one_error_line, run, small_data  # noqa: F401

from tensor_capture import schema
from tensor_capture.patcher import prepare_patched_megatron
from training_driver.megatron_env import free_port


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> str:
    return str(prepare_patched_megatron(tmp_path_factory.mktemp("patched")))


def _train(data, tmp_path, patched, iters: int, tensors: str, config: str, *extra: str):
    cfg = tmp_path / f"{tensors}.yaml"
    cfg.write_text(config)
    cmd = [sys.executable, "-m", "training_driver.train", "--data-path", data["data_path"],
           "--tokenizer", data["tokenizer"], "--model", "tiny", "--seq-length", "32",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters),
           "--checkpoint-dir", str(tmp_path / "ckpt"), *extra]
    return run(cmd, cwd=tmp_path, timeout=300, TENSOR_SAVE_ENABLED="true",
               TENSOR_SAVE_DIR=str(tmp_path / tensors), TENSOR_SAVE_CONFIG=str(cfg),
               MEGATRON_LOWP_PATCHED_DIR=patched, MASTER_PORT=str(free_port()))


def test_driver_numbers_iterations_and_samples_and_resumes(small_data, tmp_path, patched):
    first = _train(small_data, tmp_path, patched, 2, "run1", "max_iterations: unlimited\n")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    again = _train(small_data, tmp_path, patched, 4, "run2", "max_iterations: unlimited\n")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "resumed from" in again.stdout
    for d, its in (("run1", [0, 1]), ("run2", [2, 3])):
        recs = list(schema.read_manifest(tmp_path / d))
        per = Counter((r["iteration"], r["sample_idx"]) for r in recs)
        assert set(per) == {(i, s) for i in its for s in (0, 1)}      # 2 micro-batches each
        assert len(set(per.values())) == 1                           # no double counting
        assert all(schema.parse_filename(r["file"]).iteration == r["iteration"] for r in recs)


def test_a_budget_that_cannot_hold_one_iteration_exits_2_with_one_line(small_data, tmp_path,
                                                                        patched):
    # The estimate before training (training_driver.preflight) refuses such a budget up front...
    early = _train(small_data, tmp_path, patched, 3, "tiny_budget", "byte_budget: 10kB\n")
    assert early.returncode == 2 and not (tmp_path / "tiny_budget").exists()
    assert "capture: one iteration writes ~5.6 MB per rank, more than 10.0 kB" in one_error_line(early.stderr)
    # ...and past it (--ignore-resource-check) the saver still stops at the first iteration's end.
    out = _train(small_data, tmp_path, patched, 3, "tiny_budget", "byte_budget: 10kB\n",
                 "--ignore-resource-check")
    assert out.returncode == 2
    line = one_error_line(out.stderr)
    assert line.startswith("tensor capture: byte_budget 10.0 kB per rank cannot hold one iteration")
    assert "(iteration 0 needs 5.6 MB on rank 0)" in line    # what the estimate said up front
    assert "iter     2/3" not in out.stdout            # stopped at the end of the first iteration
