"""The flight recorder on real training (slow tier): llama-train on the tiny Llama through
megatron-core's schedule wrapper, the patched megatron-core, recorder mode.

- a NaN planted (tests/megatron_lm_support/plant_nan.py) in ``decoder.layers.1.mlp.linear_fc1``'s
  forward input on rank 0 at iteration 37 of 60, two data-parallel ranks: both ranks trigger at
  37, the ring holds 34..37 (W = 4), the full capture 38..39 (J = 2), ``lowp-diagnose`` names the
  planted module and micro-batch first; the replay file's command, run as written, resumes from
  the checkpoint of iteration 35 and finds the fault in the same iteration, micro-batch, module;
- a learning rate that blows the loss up: a loss_spike trigger where the loss is well above the
  first ones;
- a healthy 200-iteration run: no trigger, the summaries only, at most 1 KiB per site per K; the
  losses the recorder saw are the logged ones, and they keep falling: no loss finding;
- a learning rate held at 0.3 (bf16 weights, mxfp8): the loss stops at the corpus' unigram
  level within ~40 iterations; ``lowp-diagnose`` on the recorder folder alone (no ``--loss``)
  finds the plateau, and each pre-quantization line is a change of its operand's level that held;
- a ring that cannot fit recorder_memory: one line, exit 2, before training.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from error_bounds import gamma
from training_helpers import ROOT, clean_env, one_error_line, run, small_data  # noqa: F401

from tensor_capture import schema
from tensor_capture.recorder import read as recorder_read
from tensor_viz.diagnose import diagnose
from tensor_viz.diagnose.loss import RECORDER_SOURCE

PLANTED = "decoder.layers.1.mlp.linear_fc1"
SUPPORT = ROOT / "tests" / "megatron_lm_support"


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> str:
    from training_driver.capture import prepare_patched_tree

    return str(prepare_patched_tree(tmp_path_factory.mktemp("patched")))


def _train(data, *extra: str) -> list[str]:
    return ["-m", "training_driver.train", "--data-path", data["data_path"], "--tokenizer",
            data["tokenizer"], "--model", "tiny", "--seq-length", "32", "--log-interval", "1",
            *extra]


def _config(path: Path, text: str) -> Path:
    path.write_text("mode: recorder\n" + text)
    return path


def _losses(log: str) -> dict[int, float]:
    """llama-train's logged loss by 0-based iteration (it logs iterations from 1)."""
    out = {}
    for ln in log.splitlines():
        if ln.startswith("iter ") and "| loss " in ln:
            out[int(ln.split()[1].split("/")[0]) - 1] = float(ln.split("| loss ")[1].split()[0])
    return out


def test_a_nan_at_37_of_60_triggers_every_rank_and_its_replay_finds_it(small_data, patched,
                                                                       tmp_path):
    cap = tmp_path / "cap"
    # stats_only: the triggered capture and the replay write records, not tensor files (the
    # files themselves are tested in test_capture_recorder.py), to keep this test short
    cfg = _config(tmp_path / "rec.yaml", "recorder_window: 4\nrecorder_trigger_iterations: 2\n"
                                         "recorder_summary_every: 10\nstats_only: true\n")
    env = dict(PYTHONPATH=os.pathsep.join([str(ROOT), str(SUPPORT)]),
               LOWP_TEST_PLANT_NAN=f"0:{PLANTED}:37", MEGATRON_LOWP_PATCHED_DIR=patched)
    proc = run([sys.executable, "-m", "training_driver.torchrun", "--standalone",
                "--nproc-per-node", "2",
                *_train(small_data, "--micro-batch-size", "1", "--global-batch-size", "4",
                        "--train-iters", "60", "--save-interval", "35", "--checkpoint-dir",
                        str(tmp_path / "ckpt"))],
               cwd=tmp_path, timeout=400, TENSOR_SAVE_CONFIG=str(cfg), TENSOR_SAVE_DIR=str(cap),
               **env)
    # the loop's own divergence stop waits for the triggered capture, then ends the run (exit 2)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "the loss is no longer finite at iteration 40" in one_error_line(proc.stderr)
    assert "recorder: trigger nonfinite at iteration 37" in proc.stderr
    triggers = recorder_read.read_triggers(cap)
    assert [(t["rank"], t["iteration"], t["kinds"], t["ring"], t["capture"])
            for t in triggers] == [(r, 37, ["nonfinite"], [34, 37], [38, 39]) for r in (0, 1)]
    assert triggers[0]["details"]["nonfinite"]["module_path"] == PLANTED
    per_micro = {}
    for rec in schema.read_manifest(cap):
        key = (rec["rank"], rec["iteration"])     # 34..37 from the ring, 38..39 captured
        per_micro[key] = per_micro.get(key, 0) + 1
    sites = per_micro[(0, 34)] // 2
    assert sites == 81            # training_driver.preflight.capture_sites of the tiny Llama
    assert per_micro == {(r, it): 2 * sites for r in (0, 1) for it in range(34, 40)}
    first = diagnose(cap).findings[0].to_dict()
    assert (first["kind"], first["iteration"], first["sample_idx"], first["rank"],
            first["module_path"], first["operation"], first["tensor_name"]) == (
        "first_nonfinite", 37, 0, 0, PLANTED, "forward", "input")
    # the summaries cover every iteration up to the trigger on both ranks
    rows = recorder_read.read_summaries(cap, columns=["iteration", "rank"]).to_pylist()
    assert {(r["rank"], r["iteration"]) for r in rows} >= {(r, i) for r in (0, 1)
                                                             for i in range(38)}

    (replay,) = recorder_read.read_replays(cap)
    assert replay["iteration"] == 37 and replay["checkpoint"]["iteration"] == 35
    assert (replay["capture"]["start"], replay["capture"]["end"]) == (35, 39)
    assert replay["consumed_samples"]["at_checkpoint"] == 35 * 4
    again = subprocess.run(["bash", "-c", replay["commands"]["llama-train"]], cwd=tmp_path,
                           env=clean_env(**env), capture_output=True, text=True, timeout=400)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "at iteration 35" in again.stdout
    where = Path(replay["capture"]["dir"])
    found = diagnose(where).findings[0].to_dict()
    assert (found["kind"], found["iteration"], found["sample_idx"], found["rank"],
            found["module_path"], found["tensor_name"]) == (
        "first_nonfinite", 37, 0, 0, PLANTED, "input")
    # the resumed run is the same run: its statistics of iteration 36 are the ring's
    ring = {(r["rank"], r["sample_idx"], r["counter"]): r["stats"]
            for r in schema.read_manifest(cap) if r["iteration"] == 36}
    full = [r for r in schema.read_manifest(where) if r["iteration"] == 36]
    assert len(full) == len(ring)
    by_order: dict = {}
    for r in sorted(full, key=lambda r: r["counter"]):
        by_order.setdefault((r["rank"], r["sample_idx"]), []).append(r["stats"])
    for (rank, mb), seq in by_order.items():
        mine = [ring[k] for k in sorted(k for k in ring if k[:2] == (rank, mb))]
        assert [s["numel"] for s in seq] == [s["numel"] for s in mine]
        for s, t in zip(seq, mine):
            assert t["max"] == s["max"] and t["min"] == s["min"]
            # two float32 means of the same values: each within gamma(n) * max|x| of the exact
            absmax = max(abs(s["min"]), abs(s["max"]))
            assert abs(t["mean"] - s["mean"]) <= 2 * gamma(s["numel"]) * absmax


def test_a_loss_divergence_triggers_a_loss_spike(small_data, patched, tmp_path):
    cap = tmp_path / "cap"
    cfg = _config(tmp_path / "rec.yaml", "recorder_warmup: 2\n")
    proc = run([sys.executable, *_train(small_data, "--micro-batch-size", "2", "--train-iters",
                                        "6", "--lr", "1.0", "--clip-grad", "0",
                                        "--warmup-iters", "6")],
               cwd=tmp_path, timeout=240, TENSOR_SAVE_CONFIG=str(cfg), TENSOR_SAVE_DIR=str(cap),
               MEGATRON_LOWP_PATCHED_DIR=patched)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(proc.stdout)
    spikes = [t for t in recorder_read.read_triggers(cap) if "loss_spike" in t["kinds"]]
    assert spikes, proc.stderr[-2000:]
    it = spikes[0]["iteration"]
    assert losses[it] > 2 * losses[0]                        # it diverged, really
    assert spikes[0]["details"]["loss_spike"]["loss"] == pytest.approx(losses[it], rel=1e-4)
    assert all(losses[i] < 1.5 * losses[0] for i in range(2))   # the baseline was healthy


def test_a_healthy_run_of_200_iterations_writes_summaries_only(small_data, patched, tmp_path):
    cap = tmp_path / "cap"
    cfg = _config(tmp_path / "rec.yaml", "recorder_summary_every: 50\n")
    proc = run([sys.executable, *_train(small_data, "--micro-batch-size", "2", "--train-iters",
                                        "200", "--log-interval", "50")],
               cwd=tmp_path, timeout=400, TENSOR_SAVE_CONFIG=str(cfg), TENSOR_SAVE_DIR=str(cap),
               MEGATRON_LOWP_PATCHED_DIR=patched)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trigger" not in proc.stderr.replace("a trigger (", "")
    assert recorder_read.read_triggers(cap) == [] and recorder_read.read_replays(cap) == []
    assert not list(cap.glob(schema.MANIFEST_GLOB)) and not list(cap.glob("*.pt"))
    files = recorder_read.summary_files(cap)
    assert [f.name for f in files] == [f"summary_rank0_it{i:07d}.parquet"
                                       for i in (0, 50, 100, 150)]
    rows = recorder_read.read_summaries(cap, columns=["iteration", "site"]).to_pylist()
    sites = len({r["site"] for r in rows})
    assert sites == 81 and len(rows) == 200 * sites
    per_site_per_k = max(f.stat().st_size for f in files) / sites
    assert per_site_per_k <= 1024, per_site_per_k
    print(f"summary bytes per site per 50 iterations: {per_site_per_k:.0f}")
    _same_losses(recorder_read.read_losses(cap), _losses(proc.stdout))
    result = diagnose(cap)
    assert RECORDER_SOURCE in result.checked["loss_divergence"]
    assert not [f for f in result.findings if f.kind.startswith("loss_")], result.lines(5)


def _same_losses(seen: list[tuple[int, float]], logged: dict[int, float]) -> None:
    """The recorder's losses are the log's at every logged iteration: llama-train prints 4
    decimals (half a unit of the last one) of the float32 mean over micro-batches, the recorder
    keeps their mean in float64 (one float32 rounding apart, 2^-24 relative)."""
    by_it = dict(seen)
    assert logged and set(logged) <= set(by_it)
    for it, v in logged.items():
        assert abs(by_it[it] - v) <= 0.5e-4 + 2.0**-24 * abs(v), (it, by_it[it], v)


HOLD = 30     # underflow_hold of the plateau run: a fall of a level is said once it held 30 its


def _said_levels(stderr: str) -> dict[str, list[tuple[int, str, int | None]]]:
    """The pre-quantization lines per operand: (iteration, level, the fall's first iteration)."""
    out: dict[str, list[tuple[int, str, int | None]]] = {}
    for ln in stderr.splitlines():
        if not ln.startswith("tensor capture: iteration "):
            continue
        where, said = ln[len("tensor capture: iteration "):].split(": ", 1)
        it, key = where.split(", ", 1)
        level = ("none" if "back within the margin" in said
                 else said.split("severity ")[1].split(";")[0].split(",")[0].lower())
        since = int(said.split("since iteration ")[1].split()[0].rstrip(")")) \
            if "since iteration " in said else None
        out.setdefault(key, []).append((int(it), level, since))
    return out


def test_a_high_learning_rate_plateau_is_a_finding_of_the_recorder_folder_alone(
        small_data, patched, tmp_path):
    cap = tmp_path / "cap"
    cfg = _config(tmp_path / "rec.yaml", f"underflow_hold: {HOLD}\n")
    proc = run([sys.executable, *_train(small_data, "--micro-batch-size", "2", "--train-iters",
                                        "120", "--lr", "0.3", "--min-lr", "0.3", "--dtype",
                                        "bf16")],
               cwd=tmp_path, timeout=400, TENSOR_SAVE_CONFIG=str(cfg), TENSOR_SAVE_DIR=str(cap),
               CUSTOM_QUANT_TYPE="mxfp8", MEGATRON_LOWP_PATCHED_DIR=patched)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = _losses(proc.stdout)
    _same_losses(recorder_read.read_losses(cap), logged)
    only = tmp_path / "recorder_only"          # the recorder folder alone: no log, no records
    shutil.copytree(cap / schema.RECORDER_DIR, only / schema.RECORDER_DIR)
    (f,) = [f for f in diagnose(only).findings if f.kind == "loss_divergence"]
    assert f.severity == "MEDIUM" and f.evidence["not_decreasing"], f.summary
    assert f.figure == RECORDER_SOURCE and "stops decreasing" in f.summary
    assert f.onset < 60 and f.evidence["plateau"]["last_iterations"] == [105, 119]
    # the warnings: each line a change of its operand's level; a fall only once it held
    rank = {"none": 0, "medium": 1, "high": 2}
    said = _said_levels(proc.stderr)
    assert said, proc.stderr[-2000:]            # mxfp8 at this learning rate has some to say
    for key, lines in said.items():
        previous = "none"
        for it, level, since in lines:
            assert level != previous, (key, lines)
            if rank[level] < rank[previous]:
                assert since is not None and it - since >= HOLD, (key, lines)
            previous = level


def test_a_ring_over_its_memory_is_refused_before_training(small_data, patched, tmp_path):
    cfg = _config(tmp_path / "rec.yaml", "recorder_memory: 10kB\n")
    proc = run([sys.executable, *_train(small_data, "--train-iters", "2")], cwd=tmp_path,
               timeout=240, TENSOR_SAVE_CONFIG=str(cfg), TENSOR_SAVE_DIR=str(tmp_path / "cap"),
               MEGATRON_LOWP_PATCHED_DIR=patched)
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert line.startswith("llama-train: error: tensor capture: the flight recorder needs")
    assert "recorder_memory=10.0 kB" in line and "iter " not in proc.stdout
    proc = run([sys.executable, *_train(small_data, "--train-iters", "2")], cwd=tmp_path,
               timeout=240, TENSOR_SAVE_MODE="flight", MEGATRON_LOWP_PATCHED_DIR=patched)
    assert proc.returncode == 2
    assert "TENSOR_SAVE_MODE='flight' is not a capture mode" in one_error_line(proc.stderr)
