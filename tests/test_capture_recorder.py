"""The flight recorder (mode: recorder) in one process: its settings, its statistics against the
capture's own definitions, and its triggers, ring, summaries and replay file on megatron-core's
schedule interface (tensor_capture.numbering.wrap_schedule over a schedule of our own).
The runs of llama-train on the tiny Llama are in tests/test_capture_recorder_run.py."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from error_bounds import dot_error_bound, exact_sum, exact_sumsq, gamma, sum_error_bound

from quant import cbuild
from tensor_capture import numbering, schema, stats
from tensor_capture import saver as ts
from tensor_capture.config import ConfigError, load_config
from tensor_capture.recorder import flight as recorder
from tensor_capture.recorder import read as recorder_read
from tensor_capture.recorder.ring import ring_bytes
from tensor_capture.recorder.stats import (
    CHUNK,
    FLUSH,
    INF,
    MAX,
    MIN,
    NAN,
    SAT,
    SUM,
    SUMSQ,
    device_row,
    host_row,
    judged_format,
)


# -- settings --------------------------------------------------------------------------------------
def test_the_mode_turns_the_recorder_on_from_the_environment_or_the_file(tmp_path):
    c = load_config(env={"TENSOR_SAVE_MODE": "recorder"})
    assert c.enabled and c.mode == "recorder" and c.recorder_window == 8
    cfg = tmp_path / "rec.yaml"
    cfg.write_text("mode: recorder\nrecorder_window: 3\nrecorder_memory: 1MiB\n"
                   "recorder_trigger_iterations: 4\nrecorder_summary_every: 7\n")
    c = load_config(cfg, env={})
    assert (c.enabled, c.recorder_window, c.recorder_memory, c.recorder_trigger_iterations,
            c.recorder_summary_every) == (True, 3, 2**20, 4, 7)
    assert not load_config(env={"TENSOR_SAVE_MODE": "capture"}).enabled
    assert not load_config(cfg, env={"TENSOR_SAVE_ENABLED": "false"}).enabled   # asked: off


@pytest.mark.parametrize("key, value, fragment", [
    ("mode", "flight", "mode='flight' is not a capture mode: use capture or recorder"),
    ("recorder_window", 0, "recorder_window=0 must be >= 1"),
    ("recorder_trigger_iterations", 0, "recorder_trigger_iterations=0 must be >= 1"),
    ("recorder_summary_every", -2, "recorder_summary_every=-2 must be >= 1"),
    ("recorder_every", 0, "recorder_every=0 must be >= 1"),
    ("recorder_memory", "lots", "recorder_memory='lots' is not a size"),
    ("recorder_sigma", 0, "recorder_sigma=0.0 must be a positive number"),
])
def test_bad_recorder_settings_are_one_line(tmp_path, key, value, fragment):
    cfg = tmp_path / "rec.yaml"
    cfg.write_text(f"mode: recorder\n{key}: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg, env={})
    assert fragment in str(err.value) and str(cfg) in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="TENSOR_SAVE_MODE='x'"):
        load_config(env={"TENSOR_SAVE_MODE": "x"})


def test_the_preflight_refuses_a_ring_that_does_not_fit_its_memory():
    from lowp_common.cli import UserError
    from training_driver.preflight import capture_sites, check_recorder
    from training_driver.train_config import MODEL_SHAPES

    shape = MODEL_SHAPES["tiny"]
    c = load_config(env={}, mode="recorder")
    sites = capture_sites(shape, c, shape["num_layers"])
    # 7 tensors per linear (3 forward, 4 backward), 9 per attention (+ the probabilities' sample)
    assert sites == 2 * (4 * 7 + 9) + 7
    need = check_recorder(c, shape, num_micro_batches=4)
    assert need == ring_bytes(sites * 4, c.recorder_window, c.recorder_every)
    small = load_config(env={}, mode="recorder", recorder_memory=need - 1)
    with pytest.raises(UserError) as err:
        check_recorder(small, shape, num_micro_batches=4)
    msg = str(err.value)
    assert "more than recorder_memory" in msg and "\n" not in msg and f"{sites} tensors" in msg
    assert check_recorder(load_config(env={}), shape, 4) is None     # not recording


def test_the_adaptive_rule_has_one_definition():
    from tensor_capture import adaptive
    from training_profiler.monitor import thresholds as monitor_thresholds

    assert monitor_thresholds.AdaptiveThreshold is adaptive.AdaptiveThreshold


# -- statistics ------------------------------------------------------------------------------------
def _planted() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g) * 10
    x[:5] = torch.tensor([1e-5, -2e-6, 600.0, -900.0, 0.0])   # flushed / saturated in e4m3
    return x


@pytest.mark.parametrize("quant", ["fp8_e4m3", None])
def test_the_statistics_follow_the_capture_definitions(quant):
    x = _planted()
    fmt = judged_format(quant, x.dtype)
    spec = stats.format_range(quant) if quant else stats.dtype_range(x.dtype)
    full = stats.decode(stats.compute(x, (spec,)), (spec,))
    ranges = full[schema.STAT_RANGE][spec.name]
    # the host path sums in float32, the device path in float64: each within its own bound
    for row, acc in ((host_row(x, fmt), torch.float32), (device_row(x, fmt).tolist(),
                                                         torch.float64)):
        assert row[SAT] == ranges["upper_overflow_count"] + ranges["lower_overflow_count"]
        assert row[FLUSH] == ranges["flush_to_zero_count"]
        assert (row[MIN], row[MAX]) == (full["min"], full["max"])
        assert abs(row[SUM] - exact_sum(x)) <= sum_error_bound(x, acc) + sum_error_bound(
            x, torch.float64)
        assert abs(row[SUMSQ] - exact_sumsq(x)) <= dot_error_bound(x, x, acc) + dot_error_bound(
            x, x, torch.float64)
        assert row[NAN] == row[INF] == 0
    if quant:
        assert host_row(x, fmt)[SAT] == 2 and host_row(x, fmt)[FLUSH] == 2
    else:     # a value never saturates or flushes in its own dtype
        assert host_row(x, fmt)[SAT] == host_row(x, fmt)[FLUSH] == 0


def test_non_finite_values_are_counted_and_left_out_of_the_moments():
    x = _planted()
    x[10], x[11], x[12] = float("nan"), float("inf"), float("-inf")
    fmt = judged_format("fp8_e4m3", x.dtype)
    finite = x[torch.isfinite(x)].double()
    for row in (host_row(x, fmt), device_row(x, fmt).tolist()):
        assert (row[NAN], row[INF]) == (1, 2)
        assert row[SAT] == 2 + 2                           # +-Inf overflow too
        assert abs(row[SUM] - exact_sum(finite)) <= 2 * sum_error_bound(finite, torch.float64)
        assert (row[MIN], row[MAX]) == (float(finite.min()), float(finite.max()))


# -- a session on the schedule interface ------------------------------------------------------------
SITES = 3
MICRO = 2


def _site(i: int) -> schema.CaptureSite:
    return schema.CaptureSite(layer_type="linear", operation="forward", phase="pre",
                              tensor_name=f"t{i}", module_path=f"decoder.layers.{i}.mlp",
                              layer_idx=i, component="linear")


def _run(iterations: int, plant: dict, losses: dict | None = None,
         touch: tuple[int, object] | None = None) -> None:
    """``iterations`` training calls of a schedule with MICRO micro-batches capturing SITES
    tensors each; ``plant``: iteration -> (micro-batch, site) given a NaN; ``losses``:
    iteration -> the loss each micro-batch returns (default 1.0)."""
    losses = losses or {}
    g = torch.Generator().manual_seed(0)

    def forward_step(data_iterator, model):
        saver = ts.get_tensor_saver()
        it, mb = saver.iteration, saver.sample_idx
        for i in range(SITES):
            x = torch.randn(256, generator=g)
            if plant.get(it) == (mb, i):
                x[17] = float("nan")
            saver.capture(x, _site(i))
        return losses.get(it, 1.0 + 0.01 * (it % 3))

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches,
                 forward_only=False):
        return [forward_step_func(data_iterator, model) for _ in range(num_microbatches)]

    step = numbering.wrap_schedule(schedule)
    for it in range(iterations):
        if touch is not None and touch[0] == it:
            touch[1].touch()
        step(forward_step_func=forward_step, data_iterator=None, model=[None],
             num_microbatches=MICRO)
    ts.get_tensor_saver().close()


@pytest.fixture
def session(tmp_path):
    def start(**kw):
        settings = dict(enabled=True, save_dir=str(tmp_path), mode="recorder",
                        recorder_window=3, recorder_trigger_iterations=2,
                        recorder_summary_every=4, recorder_warmup=3)
        settings.update(kw)
        return ts.configure(**settings)
    yield start
    ts.reset_tensor_saver()


def test_a_nan_triggers_once_with_the_ring_before_it_and_full_capture_after(session, tmp_path):
    session()
    # a NaN at iteration 5 (micro-batch 1, site 1) and again at 6: one trigger (the kind re-arms
    # only after a clean iteration); a third at 10, after clean ones: a second trigger
    _run(12, {5: (1, 1), 6: (1, 1), 10: (0, 2)})
    triggers = recorder_read.read_triggers(tmp_path)
    assert [(t["iteration"], t["kinds"], t["ring"], t["capture"]) for t in triggers] == [
        (5, ["nonfinite"], [3, 5], [6, 7]), (10, ["nonfinite"], [8, 10], [11, 12])]
    assert triggers[0]["details"]["nonfinite"] == {
        "module_path": "decoder.layers.1.mlp", "tensor_name": "t1", "operation": "forward",
        "sample_idx": 1, "slot": SITES + 1}
    records = list(schema.read_manifest(tmp_path))
    by_it: dict[int, list] = {}
    for r in records:
        by_it.setdefault(r["iteration"], []).append(r)
    assert sorted(by_it) == [3, 4, 5, 6, 7, 8, 9, 10, 11]    # 12 never ran
    for it, recs in by_it.items():
        assert len(recs) == SITES * MICRO
        ring = it in (3, 4, 5, 8, 9, 10)
        assert all((r["file"] is None) == ring for r in recs), it
    # the ring's records: execution order in counter, the NaN where it was planted
    ring5 = sorted(by_it[5], key=lambda r: r["counter"])
    assert [(r["sample_idx"], r["tensor_name"]) for r in ring5] == [
        (m, f"t{i}") for m in range(MICRO) for i in range(SITES)]
    assert [r["stats"]["nan_count"] for r in ring5] == [0, 0, 0, 0, 1, 0]
    from tensor_viz.diagnose import diagnose

    first = diagnose(tmp_path).findings[0].to_dict()
    assert (first["kind"], first["iteration"], first["sample_idx"], first["module_path"],
            first["tensor_name"]) == ("first_nonfinite", 5, 1, "decoder.layers.1.mlp", "t1")
    replay = recorder_read.read_replays(tmp_path)
    assert [r["iteration"] for r in replay] == [5, 10]
    assert replay[0]["capture"]["start"] == 3 and replay[0]["capture"]["end"] == 7
    assert replay[0]["env"]["TENSOR_SAVE_MODE"] == "capture"
    assert "iterations:\n  end: 7\n  start: 3" in open(replay[0]["capture"]["config"]).read()


def test_summaries_merge_micro_batches_as_the_ring_holds_them(session, tmp_path):
    session(recorder_window=20)
    _run(9, {8: (0, 0)})                 # the trigger at 8 writes the ring of 0..8
    rows = recorder_read.summary_rows(tmp_path)
    assert sorted({r["iteration"] for r in rows}) == list(range(9))
    assert len(rows) == 9 * SITES and {r["micro_batches"] for r in rows} == {MICRO}
    ring = {(r["iteration"], r["tensor_name"], r["sample_idx"]): r["stats"]
            for r in schema.read_manifest(tmp_path)}
    for row in rows:
        parts = [ring[(row["iteration"], row["tensor_name"], m)] for m in range(MICRO)]
        assert row["count"] == sum(p["numel"] for p in parts)
        assert row["nan_count"] == sum(p["nan_count"] for p in parts)
        if not row["nan_count"]:
            assert row["min"] == pytest.approx(min(p["min"] for p in parts))
            assert row["max"] == pytest.approx(max(p["max"] for p in parts))
            assert row["mean"] == pytest.approx(sum(p["mean"] for p in parts) / MICRO)
    assert [f.name for f in recorder_read.summary_files(tmp_path)] == [
        "summary_rank0_it0000000.parquet", "summary_rank0_it0000004.parquet",
        "summary_rank0_it0000008.parquet"]


def test_a_loss_spike_a_grad_norm_spike_and_a_request_trigger(session, tmp_path):
    session()
    _run(12, {}, losses={8: 9.0}, touch=(4, tmp_path / "TRIGGER"))
    got = [(t["iteration"], t["kinds"]) for t in recorder_read.read_triggers(tmp_path)]
    assert got == [(4, ["user_request"]), (8, ["loss_spike"])]
    assert recorder_read.read_triggers(tmp_path)[1]["details"]["loss_spike"]["loss"] == 9.0
    ts.reset_tensor_saver()
    (tmp_path / "g").mkdir()
    session(save_dir=str(tmp_path / "g"))
    saver = ts.get_tensor_saver()
    for it, norm in enumerate([1.0, 1.1, 0.9, 1.0, 1.05, 20.0, 1.0]):
        saver.set_iteration(it)
        saver.capture(torch.ones(8), _site(0))
        recorder.report(grad_norm=norm)
        numbering.end_iteration(saver, it)
    got = [(t["iteration"], t["kinds"]) for t in recorder_read.read_triggers(tmp_path / "g")]
    assert got == [(5, ["grad_norm_spike"])]


def test_a_healthy_session_writes_summaries_only(session, tmp_path):
    session(recorder_summary_every=5)
    _run(10, {})
    assert recorder_read.read_triggers(tmp_path) == []
    assert not list(tmp_path.glob(schema.MANIFEST_GLOB)) and not list(tmp_path.glob("*.pt"))
    assert len(recorder_read.summary_files(tmp_path)) == 2
    assert not (tmp_path / "recorder" / "replay_it0000000.json").exists()
    assert json.loads(json.dumps(recorder_read.summary_rows(tmp_path)[0]))["site"] == 0
    assert math.isfinite(recorder_read.summary_rows(tmp_path)[0]["std"])


def _summary(folder) -> tuple[list[tuple], list[float]]:
    rows = recorder_read.summary_rows(folder)
    return ([(r["iteration"], r["site"], r["count"], r["nan_count"], r["min"], r["max"])
             for r in rows], [v for r in rows for v in (r["sum"], r["sumsq"])])


def test_the_device_path_gives_what_the_host_path_gives(session, tmp_path, monkeypatch):
    from tensor_capture.recorder.flight import Recorder

    (tmp_path / "host").mkdir()
    (tmp_path / "dev").mkdir()
    session(save_dir=str(tmp_path / "host"))
    _run(8, {5: (1, 1)})
    ts.reset_tensor_saver()
    monkeypatch.setattr(Recorder, "host_path", False)     # the buffer copied at the boundary
    session(save_dir=str(tmp_path / "dev"))
    _run(8, {5: (1, 1)})
    # the same counts and extremes; the sums within float32's summation bound (the host path
    # sums in float32, the device path in float64), which a row's own count and extremes give:
    # sum |x| <= count * absmax
    (dev, dev_sums), (host, host_sums) = _summary(tmp_path / "dev"), _summary(tmp_path / "host")
    assert dev == host
    for (_, _, count, _, lo, hi), i in zip(host, range(0, len(host_sums), 2)):
        absmax = max(abs(lo), abs(hi))
        assert abs(dev_sums[i] - host_sums[i]) <= 2 * gamma(count) * count * absmax
        assert abs(dev_sums[i + 1] - host_sums[i + 1]) <= 2 * gamma(count) * count * absmax ** 2
    assert [t["iteration"] for t in recorder_read.read_triggers(tmp_path / "dev")] == [5]


def test_every_n_iterations_judges_the_block_and_names_its_first_flagged_iteration(session,
                                                                                   tmp_path):
    session(recorder_every=3, recorder_window=6)
    _run(12, {4: (0, 0)})        # block 3..5: the NaN in 4 is seen at 5's boundary
    (t,) = recorder_read.read_triggers(tmp_path)
    assert (t["iteration"], t["ring"], t["capture"]) == (4, [0, 5], [6, 7])
    first = min((r for r in schema.read_manifest(tmp_path) if r["stats"]["nan_count"]),
                key=lambda r: (r["iteration"], r["counter"]))
    assert (first["iteration"], first["sample_idx"], first["tensor_name"]) == (4, 0, "t0")


def test_a_flush_ratio_jump_in_the_emulated_format_triggers(session, tmp_path):
    session(quant_type="fp8_e4m3")
    saver = ts.get_tensor_saver()
    g = torch.Generator().manual_seed(1)
    for it in range(10):
        saver.set_iteration(it)
        scale = 1e-4 if it == 7 else 1.0          # most of it below e4m3's smallest subnormal
        for i in range(SITES):
            saver.capture(torch.randn(512, generator=g) * scale, _site(i))
        numbering.end_iteration(saver, it)
    (t,) = recorder_read.read_triggers(tmp_path)
    assert (t["iteration"], t["kinds"]) == (7, ["flush_jump"])
    assert t["details"]["flush_jump"]["flush_ratio"] > 0.5
    rows = [r for r in recorder_read.summary_rows(tmp_path) if r["iteration"] == 7]
    assert all(r["flush_ratio"] > 0.5 and r["quant_type"] == "fp8_e4m3" for r in rows)


def test_the_replay_file_under_megatron_lm_resumes_pretrain_gpt_from_its_checkpoint(
        tmp_path, monkeypatch):
    """Megatron-LM's arguments (megatron.training.global_vars) give the checkpoint folder, the
    batch and the command line; the replay drops --load/--save and resumes from the last
    checkpoint at or before the trigger."""
    import types

    from tensor_capture.recorder.replay import write_replay

    save = tmp_path / "ckpt"
    for it in (10, 20, 30):
        (save / f"iter_{it:07d}").mkdir(parents=True)
    args = types.SimpleNamespace(save=str(save), global_batch_size=16,
                                 consumed_train_samples=26 * 16)
    monkeypatch.setitem(__import__("sys").modules, "megatron.training.global_vars",
                        types.SimpleNamespace(_GLOBAL_ARGS=args))
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--num-layers", "2", "--save",
                                     str(save), "--load=/elsewhere", "--train-iters", "100"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = load_config(env={}, mode="recorder", save_dir=str(tmp_path / "cap"),
                         recorder_window=4, layers=[1])
    path = write_replay(tmp_path / "cap" / "recorder", 25, ["loss_spike"], config, 27)
    replay = json.loads(path.read_text())
    assert replay["checkpoint"] == {"iteration": 20, "dir": str(save)}
    assert replay["consumed_samples"] == {"at_checkpoint": 20 * 16, "at_trigger": 26 * 16}
    assert (replay["capture"]["start"], replay["capture"]["end"]) == (22, 27)
    cmd = replay["commands"]["pretrain_gpt"]
    assert "pretrain_gpt.py --num-layers 2 --train-iters 100 --load " + str(save) in cmd
    assert "--ckpt-step 20" in cmd and "--exit-interval 28" in cmd
    assert "/elsewhere" not in cmd and cmd.count(str(save)) == 1
    assert cmd.startswith("TENSOR_SAVE_ENABLED=true TENSOR_SAVE_MODE=capture ")
    settings = load_config(replay["capture"]["config"], env={})
    assert (settings.mode, settings.iter_start, settings.iter_end, settings.layers) == (
        "capture", 22, 27, (1,))


def test_a_large_tensor_is_reduced_piece_by_piece_to_the_same_numbers():
    # small integers: every partial sum of values and of squares (at most 2.4e6 < 2**24 in a
    # piece) is exact in float32 in any order, so the pieces' sums must equal the whole's exactly
    # on every processor; a piece lost or counted twice changes them
    x = torch.randint(-3, 4, (2 * CHUNK + 3 * 1024 + 5,),
                      generator=torch.Generator().manual_seed(5)).float()
    assert x.numel() > CHUNK and CHUNK * 3 ** 2 + 40 ** 2 < 2 ** 24
    x[CHUNK + 9] = 40.0                                   # the max in the second piece
    fmt = judged_format(None, x.dtype)
    host, dev = host_row(x, fmt), device_row(x, fmt).tolist()
    assert (host[MIN], host[MAX]) == (dev[MIN], dev[MAX]) and host[MAX] == 40.0
    assert host[SUM] == dev[SUM] == exact_sum(x)
    assert host[SUMSQ] == dev[SUMSQ] == exact_sumsq(x)
    assert host_row(x[CHUNK:], fmt)[SUMSQ] == exact_sumsq(x[CHUNK:])   # the tail's pieces alone
    x[2 * CHUNK + 7] = float("nan")                      # in the last piece: the general path
    assert host_row(x, fmt)[NAN] == 1


def test_a_step_that_raises_writes_the_ring_with_its_partial_iteration(session, tmp_path):
    """Megatron-LM's own NaN check raises inside the loss function, before the schedule
    returns: the ring (this iteration's records so far included) is written all the same."""
    session()
    g = torch.Generator().manual_seed(0)

    def forward_step(data_iterator, model):
        saver = ts.get_tensor_saver()
        for i in range(SITES):
            x = torch.randn(64, generator=g)
            if saver.iteration == 6 and i == 2:
                x[0] = float("nan")
            saver.capture(x, _site(i))
        if saver.iteration == 6:
            raise RuntimeError("Rerun state machine: NaN in the loss\nsecond line")
        return 1.0

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches,
                 forward_only=False):
        return [forward_step_func(data_iterator, model) for _ in range(num_microbatches)]

    step = numbering.wrap_schedule(schedule)
    with pytest.raises(RuntimeError, match="Rerun state machine"):
        for _ in range(10):
            step(forward_step_func=forward_step, data_iterator=None, model=[None],
                 num_microbatches=MICRO)
    (t,) = recorder_read.read_triggers(tmp_path)
    assert (t["iteration"], t["kinds"], t["ring"], t["capture"]) == (6, ["error"], [4, 6], None)
    assert t["details"]["error"]["error"] == "RuntimeError: Rerun state machine: NaN in the loss"
    assert t["details"]["nonfinite"]["tensor_name"] == "t2"
    its = sorted({r["iteration"] for r in schema.read_manifest(tmp_path)})
    assert its == [4, 5, 6]
    partial = [r for r in schema.read_manifest(tmp_path) if r["iteration"] == 6]
    assert [(r["sample_idx"], r["tensor_name"]) for r in partial] == [(0, "t0"), (0, "t1"),
                                                                      (0, "t2")]
    assert [r["iteration"] for r in recorder_read.read_replays(tmp_path)] == [6]
    assert max(r["iteration"] for r in recorder_read.summary_rows(tmp_path)) == 6


def test_sigusr1_asks_for_a_trigger_while_the_recorder_runs(session, tmp_path):
    import os
    import signal

    session()
    saver = ts.get_tensor_saver()
    for it in range(4):
        saver.set_iteration(it)
        saver.capture(torch.ones(8), _site(0))
        if it == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        numbering.end_iteration(saver, it)
    saver.close()
    (t,) = recorder_read.read_triggers(tmp_path)
    assert (t["iteration"], t["kinds"], t["details"]["user_request"]) == (
        2, ["user_request"], {"signal": "SIGUSR1"})
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL      # given back at close


def test_cpu_rows_come_from_the_one_pass_kernel_or_else_the_torch_path_alike(
        session, monkeypatch, capsys):
    """CPU tensors' rows come from tensor_capture.stats_cpu; without a compiler the torch path
    writes the same rows (small integers: every sum exact in both) and the recorder says once
    why it is slower."""
    if cbuild.compiler() is None:
        pytest.skip("no C compiler here")
    rings = []
    for with_kernel in (True, False):
        if not with_kernel:
            monkeypatch.delenv("CC", raising=False)
            monkeypatch.setattr(cbuild, "COMPILERS", ())
        session()
        saver = ts.get_tensor_saver()
        g = torch.Generator().manual_seed(0)
        for it in range(3):
            saver.set_iteration(it)
            for mb in range(MICRO):
                saver.set_sample_idx(mb)
                for i in range(SITES):
                    x = torch.randint(-8, 9, (3000 + i,), generator=g).float()
                    if (it, mb, i) == (1, 1, 2):
                        x[5], x[6] = float("nan"), float("-inf")
                    saver.capture(x[::2] if i == 1 else x, _site(i))   # one strided view
            numbering.end_iteration(saver, it)
        rec = saver.recorder
        assert (rec._kernel.module is not None) == with_kernel
        rings.append([(e.stats.copy(), e.count.copy()) for e in rec.book.ring])
    (kernel_ring, torch_ring) = rings
    assert len(kernel_ring) == 3 and kernel_ring[1][0][2 * SITES - 1][NAN] == 1
    for (a, ca), (b, cb) in zip(kernel_ring, torch_ring):
        assert a.tolist() == b.tolist() and ca.tolist() == cb.tolist()
    err = capsys.readouterr().err
    assert err.count("CPU statistics take the slower torch path (no C compiler found") == 1


def test_a_site_object_seen_again_and_an_equal_new_one_fill_the_same_slots(session):
    """The hot path finds a slot by the site object's identity (hooks._at hands the same
    object every step); an equal object built anew (save_tensor's callers) takes the lookup by
    value: both give the same slots, rows, counts and seen flags as the torch path. A parameter
    is read once per version: updated in place between its two uses, it is read again."""
    g = torch.Generator().manual_seed(1)
    data = [[torch.randint(-8, 9, (500 + 7 * i,), generator=g).float() for i in range(SITES)]
            for _ in range(2 * MICRO)]
    weight = torch.nn.Parameter(torch.randint(-8, 9, (64,), generator=g).float())
    kept = [_site(i) for i in range(SITES)]
    wsite = dataclasses.replace(_site(0), tensor_name="weight")
    rings = []
    for same_objects, kernel in ((True, True), (False, True), (True, False)):
        session()
        saver = ts.get_tensor_saver()
        saver.recorder.cpu_kernel = kernel
        with torch.no_grad():
            weight.copy_(torch.arange(64.0) - 32)
        for it in range(2):
            saver.set_iteration(it)
            for mb in range(MICRO):
                saver.set_sample_idx(mb)
                for i in range(SITES):
                    site = kept[i] if same_objects else _site(i)
                    saver.capture(data[2 * it + mb][i][::1 + i % 2], site)
                saver.capture(weight, wsite)
                if (it, mb) == (1, 0):
                    with torch.no_grad():
                        weight.mul_(2)            # a new version: not the earlier row
            numbering.end_iteration(saver, it)
        book = saver.recorder.book
        assert len(book) == (SITES + 1) * MICRO
        rings.append([(e.stats.tolist(), e.count.tolist(), e.seen.tolist()) for e in book.ring])
    assert rings[0] == rings[1] == rings[2]
    w_rows = [stats[s] for stats, _, _ in rings[0] for s in (SITES, 2 * SITES + 1)]
    assert w_rows[0] == w_rows[1] and w_rows[2] != w_rows[3]
    assert w_rows[3][SUM] == 2 * w_rows[2][SUM] == 2 * float((torch.arange(64.0) - 32).sum())


@pytest.mark.parametrize("quant", ["fp8_e4m3", None])
def test_the_fused_kernel_row_is_the_torch_row(quant):
    """CUDA tensors take tensor_capture.stats' fused Triton pass (here Triton's interpreter)."""
    pytest.importorskip("triton")
    x = _planted()[:1024].clone()
    x[10], x[11] = float("nan"), float("-inf")
    fmt = judged_format(quant, x.dtype)
    fused, plain = device_row(x, fmt, kernel=True).tolist(), device_row(x, fmt).tolist()
    for i in (MIN, MAX, NAN, INF, FLUSH, SAT):
        assert fused[i] == plain[i], i
    # both accumulate in float64; the kernel's sums come back through its mean and Chan-combined
    # centred variance (a few float64 operations per element: gamma(8 n) covers them)
    finite = x[torch.isfinite(x)]
    n = finite.numel()
    assert abs(fused[SUM] - plain[SUM]) <= gamma(8 * n, torch.float64) * float(
        finite.double().abs().sum())
    assert abs(fused[SUMSQ] - plain[SUMSQ]) <= gamma(8 * n, torch.float64) * exact_sumsq(finite)


def test_stop_on_trigger_ends_the_run_after_the_triggered_capture(session, tmp_path, capsys):
    session(recorder_stop_on_trigger=True)
    with pytest.raises(SystemExit) as stop:
        _run(20, {5: (0, 0)})
    assert stop.value.code == 0
    assert sorted({r["iteration"] for r in schema.read_manifest(tmp_path)}) == [3, 4, 5, 6, 7]
    assert "stopping after iteration 7 (recorder_stop_on_trigger)" in capsys.readouterr().err
    assert max(r["iteration"] for r in recorder_read.summary_rows(tmp_path)) == 7
