"""Diagnosis and the report on a flight recorder's output (issue 41 item 5).

One real run of llama-train (megatron-core's schedule, the tiny model) in recorder mode with a
NaN planted in micro-batch 1 of layer 1's fc1 input at iteration 37: lowp-diagnose must name that
iteration, micro-batch, rank and module from the ring the trigger wrote, name the iteration and
module from the summaries alone when only they are there, see drift over iterations no record
covers, and the report must draw the run's timeline from the summaries.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
from training_helpers import ROOT, clean_env, small_data  # noqa: F401  (fixture)

from tensor_capture import schema
from tensor_capture.recorder import read as recorder_read

PLANT_ITERATION, PLANT_MICRO_BATCH = 37, 1
PLANT_MODULE = "decoder.layers.1.mlp.linear_fc1"
ITERATIONS = 42
SUPPORT = ROOT / "tests" / "megatron_lm_support"


@pytest.fixture(scope="module")
def recorded(small_data, tmp_path_factory):
    """The run's capture folder (ring dumps, triggered capture, summaries, triggers)."""
    work = tmp_path_factory.mktemp("recorder_diag")
    caps = work / "caps"
    env = clean_env(TENSOR_SAVE_MODE="recorder", TENSOR_SAVE_DIR=str(caps),
                    LOWP_TEST_PLANT_NAN=f"0:{PLANT_MODULE}:{PLANT_ITERATION}:{PLANT_MICRO_BATCH}")
    env["PYTHONPATH"] = f"{SUPPORT}:{env['PYTHONPATH']}"
    proc = subprocess.run(
        [sys.executable, "-m", "training_driver.train", "--data-path", small_data["data_path"],
         "--tokenizer", small_data["tokenizer"], "--model", "tiny", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", str(ITERATIONS), "--warmup-iters", "4",
         "--checkpoint-dir", str(work / "ck"), "--save-interval", "20", "--log-interval", "50"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300)
    # the loss turns NaN after the plant; the loop may stop on it (exit 2) once the recorder
    # has captured the iterations after the trigger: both are the run the user would have
    assert proc.returncode in (0, 2), proc.stderr[-3000:]
    assert PLANT_ITERATION in recorder_read.trigger_iterations(caps), proc.stderr[-3000:]
    return caps


def _diagnose(folder):
    from tensor_viz.diagnose import diagnose

    return diagnose(folder)


def test_ring_names_iteration_micro_batch_rank_and_module(recorded):
    result = _diagnose(recorded)
    top = result.findings[0].to_dict()
    assert top["kind"] == "first_nonfinite"
    assert (top["iteration"], top["sample_idx"], top["rank"], top["module_path"]) == (
        PLANT_ITERATION, PLANT_MICRO_BATCH, 0, PLANT_MODULE)
    assert (top["operation"], top["tensor_name"]) == ("forward", "input")
    assert result.summary_rows > 0
    assert "iteration 37: " in result.checked["recorder"]


def test_summaries_alone_name_the_iteration_and_module(recorded, tmp_path):
    only = tmp_path / "summaries_only"
    shutil.copytree(recorded / schema.RECORDER_DIR, only / schema.RECORDER_DIR)
    result = _diagnose(only)
    assert result.records == 0 and result.summary_rows > 0
    top = result.findings[0].to_dict()
    assert top["kind"] == "first_nonfinite"
    assert (top["iteration"], top["sample_idx"], top["module_path"]) == (
        PLANT_ITERATION, None, PLANT_MODULE)
    assert "micro-batches merged" in top["summary"]
    # a kind that needs what summaries lack says so; every other kind ran on them
    assert result.checked["format_loss"] == ("not checked: needs what-if numerics, which "
                                             "recorder summaries do not keep")
    assert result.checked["attention_logit_growth"].startswith("not checked: needs the query's")
    assert all(not v.startswith("not checked") for k, v in result.checked.items()
               if k not in ("format_loss", "attention_logit_growth"))


def test_summaries_fill_only_the_iterations_records_do_not_cover(recorded):
    from tensor_viz.diagnose import open_index, recorder_view, rules

    con, state = open_index(recorded)
    src = rules.materialize(con, state)
    covered = {r for r in con.execute(f"SELECT DISTINCT rank, iteration FROM {src}").fetchall()}
    added = recorder_view.add_summaries(con, src, recorded)
    table = recorder_read.read_summaries(recorded).to_pylist()
    expected = sum(1 for r in table if (r["rank"], r["iteration"]) not in covered)
    assert added == expected > 0
    # the whole run is now seen: iteration 0 (never in a record) through the last summarised
    its = {r[0] for r in con.execute(f"SELECT DISTINCT iteration FROM {src}").fetchall()}
    assert min(its) == 0 and PLANT_ITERATION in its
    # the summary rows' moments are the reader's (recorder_read.moments), merged from the sums
    row = next(r for r in table if (r["rank"], r["iteration"]) not in covered and r["count"] > 2
               and r["nan_count"] == 0)
    mean, std = recorder_read.moments(row["count"], row["nan_count"], row["inf_count"],
                                      row["sum"], row["sumsq"])
    got = con.execute(f"SELECT mean, std, absmax FROM {src} WHERE rank = ? AND iteration = ? "
                      "AND counter = ? AND sample_idx IS NULL",
                      [row["rank"], row["iteration"], row["site"]]).fetchone()
    assert got[0] == pytest.approx(mean, rel=1e-9) and got[1] == pytest.approx(std, rel=1e-9)
    assert got[2] == max(abs(row["min"]), abs(row["max"]))


def test_report_draws_the_run_timeline_from_the_summaries(recorded, tmp_path):
    from tensor_viz.diagnose import recorder_view
    from tensor_viz.options import Options
    from tensor_viz.pipeline import build

    t = recorder_view.timeline(recorded)
    table = recorder_read.summary_rows(recorded)
    assert t["iterations"] == sorted({r["iteration"] for r in table})
    # the per-layer absmax is the largest |x| of that layer's summary rows in each iteration
    layer1 = [r for r in table if r["layer_idx"] == 1 and r["iteration"] == 3]
    assert t["layers"]["layer 1"]["absmax"][t["iterations"].index(3)] == max(
        r["absmax"] for r in layer1 if math.isfinite(r["absmax"]))
    bad = t["layers"]["layer 1"]["nonfinite"]
    first = next(i for i, v in zip(t["iterations"], bad) if v)
    assert first == PLANT_ITERATION
    assert {g["iteration"] for g in t["triggers"]} >= {PLANT_ITERATION}

    out = tmp_path / "draw"
    result = build(recorded, out, sections=("run_timeline",),
                   opts=Options(progress=False, workers=1))
    assert (out / "run_timeline" / "run_timeline.png").is_file()
    drawn = [f for f in result.figures.figures if f.section == "run_timeline"]
    assert len(drawn) == 1 and not drawn[0].layout_issues, drawn
    page = (out / "index.html").read_text(encoding="utf-8")
    assert f"The first non-finite value appears at iteration {PLANT_ITERATION}" in page


def test_cli_reads_a_recorder_folder_json(recorded, tmp_path):
    out = tmp_path / "d.json"
    proc = subprocess.run([sys.executable, "-m", "tensor_viz.diagnose.cli", str(recorded),
                           "--json", str(out)], env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["summary_rows"] > 0
    assert data["findings"][0]["sample_idx"] == PLANT_MICRO_BATCH


# -- the loss the recorder saw: written beside its summaries, judged with no --loss ------------
def _curve(kind: str, seed: int, n: int = 300) -> list[tuple[int, float]]:
    """A loss with Gaussian noise (sd 0.15, a small batch's): ``plateau`` falls to 5.0 within
    ~30 iterations and stays (the high learning rate's run); ``falling`` keeps falling as a
    power law, half as fast per iteration in the second half as a tiny Llama at its default lr."""
    import random

    rng = random.Random(seed)
    level = {"plateau": lambda it: 5.0 + 2.0 * math.exp(-it / 10),
             "falling": lambda it: 3.0 + 3.0 / math.sqrt(1 + it / 10)}[kind]
    return [(it, level(it) + rng.gauss(0.0, 0.15)) for it in range(n)]


@pytest.mark.parametrize("seed", range(10))
def test_a_plateau_is_judged_against_the_run_s_own_early_minimum(seed):
    from tensor_viz.diagnose import first_cause
    from tensor_viz.diagnose.loss import PLATEAU_PARTS, divergence, plateau

    (f,) = divergence(_curve("plateau", seed), [], 384, first_cause)
    ev = f.evidence
    assert (f.kind, f.severity, ev["not_decreasing"]) == ("loss_divergence", "MEDIUM", True)
    assert "stops decreasing" in f.summary and f.onset < 60    # at 5.0 from its first ~40 its
    # the early minimum is a median of the first half's parts; the last part is the last eighth
    first, last = ev["plateau"]["last_iterations"]
    assert ev["plateau"]["early_iterations"][1] < 150 and last == 299
    assert abs(last + 1 - first - 300 / PLATEAU_PARTS) < 1
    # the noise estimate from successive differences recovers the curve's sd (0.15)
    assert 0.1 < ev["plateau"]["noise_std"] < 0.2
    # the same noise over a loss that keeps falling: no finding, and no plateau over 100 or 200
    # iterations either (over 40, 5 losses a part, its fall is within 2 standard errors)
    assert divergence(_curve("falling", seed), [], 384, first_cause) == []
    assert all(plateau(_curve("falling", seed, n)) is None for n in (100, 200))


def _record_losses(folder, losses: dict[int, float]) -> None:
    """A recorder session over megatron-core's schedule interface (tensor_capture.numbering's
    wrapper over a schedule of our own, two micro-batches each returning the iteration's loss)."""
    import torch

    from tensor_capture import numbering
    from tensor_capture import saver as ts

    ts.configure(enabled=True, save_dir=str(folder), mode="recorder", recorder_summary_every=64)
    site = schema.CaptureSite(layer_type="linear", operation="forward", phase="pre",
                              tensor_name="input", module_path="decoder.layers.0.mlp",
                              layer_idx=0, component="linear")
    g = torch.Generator().manual_seed(0)

    def forward_step(data_iterator, model):
        saver = ts.get_tensor_saver()
        saver.capture(torch.randn(64, generator=g), site)
        return losses[saver.iteration]

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches, forward_only=False):
        return [forward_step_func(data_iterator, model) for _ in range(num_microbatches)]

    step = numbering.wrap_schedule(schedule)
    try:
        for _ in losses:
            step(forward_step_func=forward_step, data_iterator=None, model=[None],
                 num_microbatches=2)
    finally:
        ts.get_tensor_saver().close()
        ts.reset_tensor_saver()


def test_the_recorder_s_own_losses_feed_the_loss_kinds_without_a_log(tmp_path, capsys):
    from tensor_viz.diagnose import cli as diagnose_cli
    from tensor_viz.diagnose.loss import RECORDER_SOURCE

    found = {}
    for kind in ("plateau", "falling"):
        curve = dict(_curve(kind, 0, 200))
        _record_losses(tmp_path / kind, curve)
        # every iteration's loss, written with the summaries, exactly (the schedule returns
        # Python floats here; the recorder keeps float64)
        assert recorder_read.read_losses(tmp_path / kind) == sorted(curve.items())
        assert diagnose_cli.main([str(tmp_path / kind), "--json", "-"]) == 0
        data = json.loads(capsys.readouterr().out)
        found[kind] = [f for f in data["findings"] if f["kind"] == "loss_divergence"]
        assert RECORDER_SOURCE in data["checked"]["loss_spike"]
    (f,) = found["plateau"]
    assert f["severity"] == "MEDIUM" and f["evidence"]["not_decreasing"]
    assert f["figure"] == RECORDER_SOURCE                      # where to look
    assert found["falling"] == []


def test_the_run_s_loss_is_the_mean_over_ranks_and_a_resumed_run_s_line_wins(tmp_path):
    d = tmp_path / schema.RECORDER_DIR
    d.mkdir()
    (d / schema.RECORDER_SUMMARY_GLOB.replace("*", "0", 1).replace("*", "0000000")).touch()
    lines = {0: [(0, 6.0), (1, 5.0), (1, 4.0)], 1: [(0, 8.0), (1, 6.0)]}   # rank 0 resumed at 1
    for rank, rows in lines.items():
        (d / schema.recorder_loss_name(rank)).write_text("".join(
            json.dumps({"iteration": it, "rank": rank, "loss": v}) + "\n" for it, v in rows))
    assert recorder_read.read_losses(tmp_path) == [(0, 7.0), (1, 5.0)]


# -- every kind from the summaries alone: a real 3-rank run whose rank 2 is out of scale --------
SCALED_RANK, SCALED_MODULE, SCALED_FROM, SCALE = 2, "decoder.layers.0.mlp.linear_fc1", 2, 16.0


@pytest.fixture(scope="module")
def three_ranks(small_data, tmp_path_factory):
    """llama-train on 3 data-parallel ranks (torchrun, megatron-core's schedule) in recorder
    mode, computing in unscaled fp8_e4m3 (its smallest subnormal 2^-9 flushes the tiny Llama's
    small gradients), with rank 2's input to layer 0's fc1 multiplied by 16 from iteration 2 (a
    bad shard or node); no trigger: the recorder leaves its summaries alone."""
    from training_driver.capture import prepare_patched_tree

    work = tmp_path_factory.mktemp("recorder_ranks")
    caps = work / "caps"
    proc = subprocess.run(
        [sys.executable, "-m", "training_driver.torchrun", "--standalone", "--nproc-per-node",
         "3", "-m", "training_driver.train", "--data-path", small_data["data_path"],
         "--tokenizer", small_data["tokenizer"], "--model", "tiny", "--seq-length", "32",
         "--micro-batch-size", "1", "--global-batch-size", "3", "--train-iters", "6",
         "--log-interval", "10"],
        cwd=work, capture_output=True, text=True, timeout=400, env=clean_env(
            TENSOR_SAVE_MODE="recorder", TENSOR_SAVE_DIR=str(caps), CUSTOM_QUANT_TYPE="fp8_e4m3",
            PYTHONPATH=f"{ROOT}:{SUPPORT}",
            MEGATRON_LOWP_PATCHED_DIR=str(prepare_patched_tree(work / "patched")),
            LOWP_TEST_PLANT_SCALE=f"{SCALED_RANK}:{SCALED_MODULE}:{SCALED_FROM}:{SCALE}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(caps.glob(schema.MANIFEST_GLOB)) and recorder_read.summary_files(caps)
    return caps


def test_summaries_alone_name_the_outlier_rank_and_the_run_format_s_flush(three_ranks):
    result = _diagnose(three_ranks)
    assert result.records == 0 and result.summary_rows > 0
    absmax = [f.to_dict() for f in result.findings if f.kind == "rank_outlier"
              and f.evidence["metric"] == "absmax"]
    # the scaled rank is the outlier of absmax, far beyond the others (three data-parallel
    # ranks of the tiny Llama also differ by their own batches: the test's z can flag them too)
    worst = max(absmax, key=lambda f: f["evidence"]["worst_z"])
    assert worst["rank"] == SCALED_RANK, absmax
    assert worst["evidence"]["value"] / worst["evidence"]["median"] > SCALE / 2
    # the mechanism, as the summaries saw it: the scaled input is out of scale from the
    # iteration the scale starts, on that rank only (rank_tables' band of the same cell)
    from tensor_viz import rank_tables
    from tensor_viz.columnar import connect
    from tensor_viz.diagnose import recorder_view
    from tensor_viz.diagnose.rules import NARROW, NarrowState

    con = connect()
    rows = recorder_view.narrow_from_summaries(con, NARROW, three_ranks)
    band = rank_tables.band(con, NarrowState(NARROW, rows), "absmax",
                            {"layer_idx": 0, "module_path": SCALED_MODULE, "operation": "forward",
                             "phase": "pre", "tensor_name": "input"}, SCALED_RANK)
    assert [it for it, _lo, med, _hi, mine in band if mine > SCALE / 2 * med] == list(
        range(SCALED_FROM, 6))
    # the run's own format flushes gradients: counted by the recorder in fp8_e4m3
    flush = [f for f in result.findings if f.kind == "run_format_loss"]
    assert any(f.evidence["gradient"] and f.evidence["format"] == "fp8_e4m3" for f in flush)
    rows = recorder_read.summary_rows(three_ranks)
    grads = [r for r in rows if r["tensor_name"] == "grad_output" and r["quant_type"] == "fp8_e4m3"]
    assert grads and max(r["flush_ratio"] for r in grads) > 0.01       # quant.analysis' HIGH
    assert result.checked["format_loss"].startswith("not checked: needs what-if numerics")
