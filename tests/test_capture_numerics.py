"""What-if numerics at capture and the report's numerics.csv.

Fast tests feed plain tensors to quant.whatif and to a TensorSaver and re-derive the numbers
independently (block amax by reshaping, floor(log2) by math.frexp, SQNR by its formula in
float64); the slow test captures 3 iterations of the tiny Llama through the training driver and
re-derives numerics.csv's SQNR and MX block-scale range from the stored tensors.
"""
from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch
from error_bounds import UNIT_ROUNDOFF, ratio_of_sums_bound, sqnr_db_bound
from training_helpers import small_data  # noqa: F401  (fixture of the slow test)

import quant
from quant.formats import WHATIF_FORMATS
from quant.whatif import SCALE_KIND_MX, SCALE_KIND_NVFP4, whatif
from tensor_capture import schema
from tensor_capture.config import ConfigError, load_config


def _tensor(shape=(64, 128), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x.view(-1)[::97] *= 300.0                       # outliers, so some blocks clip in mxfp8
    x.view(-1)[5::89] *= 1e-9                      # tiny values, so some flush
    return x


def _sqnr(x: torch.Tensor, q: torch.Tensor) -> float:
    x, q = x.double(), q.double()
    return 10 * math.log10(float((x * x).sum()) / float(((x - q) ** 2).sum()))


def _blocks(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """[rows, nblocks, block] along ``axis`` (the axis length a multiple of the block here)."""
    m = x.movedim(axis, -1)
    return m.reshape(-1, m.shape[-1] // block, block)


def _mx_exponents(x: torch.Tensor, axis: int, fmt: str) -> list[int]:
    spec = quant.get_format(fmt)
    amax = _blocks(x, axis, spec.block_size).abs().amax(-1).reshape(-1).tolist()
    return [math.frexp(a)[1] - 1 - spec.emax for a in amax if a > 0]


@pytest.mark.parametrize("fmt", WHATIF_FORMATS)
@pytest.mark.parametrize("axis", [-1, 0])
def test_whatif_numbers_rederive_from_quantize(fmt, axis):
    x = _tensor()
    got = whatif(x, fmt, axis)
    q = quant.quantize(x, fmt, axis=axis)
    assert got["sqnr_db"] == pytest.approx(_sqnr(x, q), abs=sqnr_db_bound(x.numel()))
    rel = float((x.double() - q.double()).abs().sum() / x.double().abs().sum())
    assert got["rel_error"] == pytest.approx(rel, rel=ratio_of_sums_bound(x.numel()))
    flushed = (x != 0) & (q == 0)
    assert got["flush_ratio"] == pytest.approx(float(flushed.double().mean()))
    spec = quant.get_format(fmt)
    if spec.block_size is None:
        assert "block_scale" not in got
        return
    # per-block flush counts, by reshaping the mask ourselves
    per_block = _blocks(flushed.int(), axis, spec.block_size).sum(-1).reshape(-1)
    assert got["block_flushed_hist"] == torch.bincount(per_block).tolist()
    clipped = got["block_clipped_hist"]
    assert sum(k * n for k, n in enumerate(clipped)) == round(got["overflow_ratio"] * x.numel())
    assert sum(clipped) == got["blocks"] == x.numel() // spec.block_size
    scale = got["block_scale"]
    if spec.scaling == "mx":
        exps = _mx_exponents(x, axis, fmt)
        assert scale["kind"] == SCALE_KIND_MX
        assert (scale["min"], scale["max"]) == (min(exps), max(exps))
        hist = scale["hist"]
        assert hist["min_bin"] == min(exps) and sum(hist["counts"]) == len(exps)
        assert hist["counts"][max(exps) - min(exps)] == exps.count(max(exps))
    else:
        assert scale["kind"] == SCALE_KIND_NVFP4
        amax = _blocks(x, axis, 16).abs().amax(-1)
        s_t = float(x.abs().max()) / (6 * 448)
        raw = (amax / 6 / s_t).clamp(2.0 ** -9, 448)
        e4m3 = quant.quantize(raw, "fp8_e4m3")
        assert scale["min"] == pytest.approx(float(e4m3.min()))
        assert scale["max"] == pytest.approx(float(e4m3.max()))


def test_the_reduction_axis_changes_the_block_numbers():
    """Columns scaled by 2^j: blocks along a row span many binades, blocks down a column one."""
    x = torch.rand(64, 64) + 1.0
    x = x * 2.0 ** torch.arange(64).float().div(4).floor()
    across = whatif(x, "mxfp8", -1)["block_dynamic_range_hist"]
    down = whatif(x, "mxfp8", 0)["block_dynamic_range_hist"]
    assert down == {"min_bin": 0, "counts": [64 * 2]}
    assert across["min_bin"] >= 7                   # 32 columns = 8 binades per block


def test_a_tensor_shorter_than_one_block_is_marked_not_dropped():
    x = _tensor((4, 8))
    got = whatif(x, "mxfp8", -1)
    assert got["short_axis"] is True and got["axis_length"] == 8 and got["blocks"] == 4
    assert got["block_scale"]["min"] is not None
    assert whatif(_tensor((4, 64)), "nvfp4", -1)["short_axis"] is False


def test_whatif_config_and_unknown_format_fails_listing_the_names():
    assert load_config(env={}).whatif_formats == ()            # opt-in (cost)
    assert load_config(env={"TENSOR_SAVE_WHATIF_FORMATS": "default"}).whatif_formats == \
        WHATIF_FORMATS
    env = {"TENSOR_SAVE_WHATIF_FORMATS": "mxfp8, nvfp4"}
    assert load_config(env=env).whatif_formats == ("mxfp8", "nvfp4")
    assert load_config(env={"TENSOR_SAVE_WHATIF_FORMATS": "none"}).whatif_formats == ()
    with pytest.raises(ConfigError) as err:
        load_config(env={"TENSOR_SAVE_WHATIF_FORMATS": "mxfp8,mxfp9"})
    msg = str(err.value)
    assert "\n" not in msg and "TENSOR_SAVE_WHATIF_FORMATS" in msg and "mxfp9" in msg
    assert all(name in msg for name in quant.FORMATS)
    with pytest.raises(ConfigError):
        load_config(env={}, whatif_formats=["fp7"])
    from tensor_capture.config import UNLIMITED, WHATIF_MAX_ELEMENTS

    assert load_config(env={}).whatif_max_elements == WHATIF_MAX_ELEMENTS
    assert load_config(env={}, whatif_max_elements="unlimited").whatif_max_elements == UNLIMITED
    with pytest.raises(ConfigError):
        load_config(env={}, whatif_max_elements=0)


@pytest.mark.parametrize("in_writer", [True, False])
def test_stats_only_capture_stores_whatif_along_the_gemm_axis(tmp_path, in_writer, monkeypatch):
    from tensor_capture.saver import TensorSaver

    monkeypatch.setattr(TensorSaver, "host_stats_in_writer", in_writer)
    saver = TensorSaver(enabled=True, save_dir=str(tmp_path), stats_only=True,
                        whatif_formats=("mxfp8", "hifp8"))
    x, g = _tensor(seed=1), _tensor(seed=2)
    saver.save_tensor(x, "linear", "forward", None, "input", 0, phase="pre", component="linear", quant_axis=-1)
    saver.save_tensor(g, "linear", "backward", None, "grad_output", 0, phase="pre", component="linear",
                      quant_axis=0)
    saver.save_tensor(x, "linear", "forward", None, "output", 0, phase="post", component="linear")
    saver.save_tensor(x, "linear", "forward", None, "input_quantized", 0, phase="pre", component="linear",
                      variant=schema.VARIANT_QUANTIZED)
    saver.close()
    recs = {r["tensor_name"]: r for r in schema.read_manifest(tmp_path)}
    assert all(r[schema.MANIFEST_FILE] is None for r in recs.values())        # stats only
    assert schema.META_WHATIF not in recs["input_quantized"]
    for name, t, axis, source in (("input", x, -1, "gemm"), ("grad_output", g, 0, "gemm"),
                                  ("output", x, -1, "last")):
        w = recs[name][schema.META_WHATIF]
        assert (w["axis"], w["axis_source"]) == (axis, source)
        assert list(w["formats"]) == ["mxfp8", "hifp8"]
        q = quant.quantize(t, "mxfp8", axis=axis)
        assert w["formats"]["mxfp8"]["sqnr_db"] == pytest.approx(_sqnr(t, q),
                                                               abs=sqnr_db_bound(t.numel()))
        exps = _mx_exponents(t, axis, "mxfp8")
        assert w["formats"]["mxfp8"]["block_scale"]["max"] == max(exps)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_large_tensors_are_sampled_in_whole_blocks_and_marked(tmp_path, axis):
    from tensor_capture import whatif as capture_whatif
    from tensor_capture.saver import TensorSaver

    x = _tensor((64, 8, 96), seed=3)
    part = capture_whatif.sample(x, axis, 4096)
    assert part.numel() <= 4096 and part.shape[axis] == x.shape[axis]   # blocks stay whole
    assert part.data_ptr() == x.data_ptr()                              # a view, no copy
    saver = TensorSaver(enabled=True, save_dir=str(tmp_path), stats_only=True,
                        whatif_formats=("mxfp8",), whatif_max_elements=4096)
    saver.save_tensor(x, "linear", "forward", None, "input", 0, phase="pre", component="linear", quant_axis=axis)
    saver.save_tensor(x[:2], "linear", "forward", None, "weight", 0, phase="pre", component="linear",
                      quant_axis=axis)
    saver.close()
    recs = {r["tensor_name"]: r[schema.META_WHATIF] for r in schema.read_manifest(tmp_path)}
    assert (recs["input"]["sampled"], recs["input"]["elements"]) == (True, part.numel())
    assert recs["input"]["formats"]["mxfp8"]["sqnr_db"] == pytest.approx(
        _sqnr(part, quant.quantize(part, "mxfp8", axis=axis)), abs=sqnr_db_bound(part.numel()))
    assert (recs["weight"]["sampled"], recs["weight"]["elements"]) == (False, x[:2].numel())


def test_whatif_every_n_iterations(tmp_path):
    from tensor_capture.saver import TensorSaver

    saver = TensorSaver(enabled=True, save_dir=str(tmp_path), stats_only=True,
                        whatif_formats=("hifp8",), whatif_every=2, iter_start=1,
                        whatif_budget="unlimited")
    for it in range(1, 6):
        saver.save_tensor(_tensor((4, 32)), "linear", "forward", None, "input", 0,
                          phase="pre", component="linear", iteration=it, quant_axis=-1)
    saver.close()
    got = {r["iteration"]: schema.META_WHATIF in r for r in schema.read_manifest(tmp_path)}
    assert got == {1: True, 2: False, 3: True, 4: False, 5: True}
    saver = TensorSaver(enabled=True, save_dir=str(tmp_path / "b"), stats_only=True,
                        whatif_formats=("hifp8",), whatif_every=2, iter_every=3,
                        whatif_budget="unlimited")
    for it in range(0, 13, 3):                      # captured: 0, 3, 6, 9, 12
        saver.save_tensor(_tensor((4, 32)), "linear", "forward", None, "input", 0,
                          phase="pre", component="linear", iteration=it, quant_axis=-1)
    saver.close()
    got = {r["iteration"]: schema.META_WHATIF in r for r in schema.read_manifest(tmp_path / "b")}
    assert got == {0: True, 3: False, 6: True, 9: False, 12: True}


def _read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as fh:
        r = csv.DictReader(fh)
        return list(r.fieldnames or []), list(r)


def _report_csv(folder, out_dir):
    """numerics.csv as the report writes it: the entries and what-if rows of pipeline.load (which
    recomputes, on capture's axis, what a record did not store)."""
    from tensor_viz import numerics_csv, pipeline
    from tensor_viz.options import Options

    _, ds, _ = pipeline.load(folder, Options(progress=False, workers=1, whatif=WHATIF_FORMATS))
    return numerics_csv.write_csv(ds.entries, out_dir, ds.numerics)


def test_numerics_csv_rows_per_tensor_and_format(tmp_path):
    from tensor_capture.synthetic import write_synthetic_run
    from tensor_viz import numerics_csv
    from tensor_viz.catalog import scan

    run = write_synthetic_run(tmp_path / "run", quant_types=("bf16",), iterations=(0, 1),
                              num_layers=1)
    entries = scan(run).entries
    assert _report_csv(run, tmp_path) == "numerics.csv"
    header, rows = _read_csv(tmp_path / "numerics.csv")
    assert header == ["file", "layer_type", "layer_idx", "operation", "phase", "component",
                      "tensor_name", "iteration", "rank", "format", "sqnr_db", "rel_error",
                      "overflow_ratio", "underflow_ratio", "flush_ratio", "block_scale_min",
                      "block_scale_max", "block_scale_std", "axis", "source", "short_axis"]
    assert len(rows) == len(entries) * len(WHATIF_FORMATS)
    assert {(r["file"], r["format"]) for r in rows} == {
        (Path(e.path).name, f) for e in entries for f in WHATIF_FORMATS}
    for r in rows:
        block = quant.get_format(r["format"]).block_size is not None
        assert all((r[c] != "") == block for c in numerics_csv.BLOCK_COLUMNS.values())
        assert (r["short_axis"] in ("true", "false")) == block
        assert math.isfinite(float(r["sqnr_db"]))


def test_numerics_csv_recomputes_a_file_without_whatif_metadata(tmp_path):

    x = _tensor((16, 64))
    name = "20240101_000000_0001_iter000002_linear_L3_forward_pre_linear_bf16_rank00_sample000_input.pt"
    torch.save({"tensor": x, "metadata": {}}, tmp_path / name)       # an older capture
    (tmp_path / "out").mkdir()
    _report_csv(tmp_path, tmp_path / "out")
    _, rows = _read_csv(tmp_path / "out" / "numerics.csv")
    mx = next(r for r in rows if r["format"] == "mxfp8")
    assert (mx["file"], mx["iteration"], mx["layer_idx"]) == (name, "2", "3")
    assert float(mx["sqnr_db"]) == pytest.approx(_sqnr(x, quant.quantize(x, "mxfp8")),
                                                abs=sqnr_db_bound(x.numel()))


def test_numerics_csv_reads_a_file_found_without_its_manifest(tmp_path):
    from tensor_capture.saver import TensorSaver

    g = torch.randn(128, 32, generator=torch.Generator().manual_seed(4))
    g[:, ::2] *= 1e3                   # blocks down a column: small or large; across a row: large
    saver = TensorSaver(enabled=True, save_dir=str(tmp_path / "cap"), whatif_formats=("mxfp8",))
    saver.save_tensor(g, "linear", "backward", None, "grad_output", 1, phase="pre", component="linear",
                      quant_axis=0)
    saver.close()
    for m in (tmp_path / "cap").glob("manifest_*"):
        m.unlink()
    (tmp_path / "out").mkdir()
    _report_csv(tmp_path / "cap", tmp_path / "out")
    _, rows = _read_csv(tmp_path / "out" / "numerics.csv")
    along0 = _sqnr(g, quant.quantize(g, "mxfp8", axis=0))
    assert float(rows[0]["sqnr_db"]) == pytest.approx(along0, abs=sqnr_db_bound(g.numel()))
    assert float(rows[0]["block_scale_min"]) == min(_mx_exponents(g, 0, "mxfp8"))
    assert min(_mx_exponents(g, 0, "mxfp8")) < min(_mx_exponents(g, -1, "mxfp8")) - 5


# -- Done when: a 3-iteration capture of the tiny Llama ------------------------------------------
@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> str:
    from tensor_capture.patcher import prepare_patched_megatron

    return str(prepare_patched_megatron(tmp_path_factory.mktemp("patched")))


def test_tiny_llama_numerics_csv_rederives_from_stored_tensors(small_data, tmp_path, patched):
    from training_helpers import run

    from tensor_viz import pipeline
    from training_driver.megatron_env import free_port

    cfg = tmp_path / "capture.yaml"
    cfg.write_text("max_iterations: unlimited\nbyte_budget: unlimited\n"
                   "whatif_formats: [mxfp8, mxfp4, nvfp4, hifp8, fp8_e4m3_tensor]\n"
                   "whatif_max_elements: unlimited\n"       # whole tensors: exact re-derivation
                   "whatif_budget: unlimited\n")              # every iteration, however slow
    cmd = [sys.executable, "-m", "training_driver.train", "--data-path", small_data["data_path"],
           "--tokenizer", small_data["tokenizer"], "--model", "tiny", "--seq-length", "32",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb")]
    out = run(cmd, cwd=tmp_path, timeout=600, TENSOR_SAVE_ENABLED="true",
              TENSOR_SAVE_DIR=str(tmp_path / "cap"), TENSOR_SAVE_CONFIG=str(cfg),
              MEGATRON_LOWP_PATCHED_DIR=patched, MASTER_PORT=str(free_port()))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    _tensorboard_matches_the_manifest(tmp_path / "tb", tmp_path / "cap")
    result = pipeline.build(tmp_path / "cap", tmp_path / "report", sections=())
    assert "numerics.csv" in result.extra_files
    _, rows = _read_csv(tmp_path / "report" / "numerics.csv")
    assert {int(r["iteration"]) for r in rows} == {0, 1, 2}
    assert {r["format"] for r in rows} == set(WHATIF_FORMATS)
    checked, mx_ranges = set(), 0
    for r in rows:
        if r["format"] not in ("mxfp8", "nvfp4") or not r["file"]:
            continue
        t, meta = schema.load_tensor_file(tmp_path / "cap" / r["file"])
        if meta.get(schema.META_SAMPLED_ROWS) is not None or not t.is_floating_point():
            continue
        assert meta[schema.META_WHATIF]["sampled"] is False
        axis = meta[schema.META_WHATIF]["axis"]
        q = quant.quantize(t, r["format"], axis=axis)
        assert float(r["sqnr_db"]) == pytest.approx(_sqnr(t, q), abs=sqnr_db_bound(t.numel())), r
        block = quant.get_format(r["format"]).block_size
        numbers = meta[schema.META_WHATIF]["formats"][r["format"]]
        # attention's head_dim (16) is shorter than an MX block: marked, not dropped
        assert numbers["short_axis"] == (t.shape[axis] < block)
        checked.add((r["tensor_name"], meta[schema.META_WHATIF]["axis_source"],
                     numbers["short_axis"]))
        if r["format"] == "mxfp8" and t.shape[axis] % block == 0:
            exps = _mx_exponents(t, axis, "mxfp8")
            assert (float(r["block_scale_min"]), float(r["block_scale_max"])) == (
                min(exps), max(exps)), r
            mx_ranges += 1
    assert mx_ranges >= 30
    # GEMM operands along their plan axes (attention's too, short), and other tensors
    assert {("input", "gemm", False), ("weight", "gemm", False), ("grad_output", "gemm", False),
            ("query", "gemm", True), ("output", "last", False),
            (schema.ATTENTION_PROBS, "gemm", False)} <= checked


def _tensorboard_matches_the_manifest(tb: Path, cap: Path) -> None:
    """The driver's --tensorboard-dir holds its loss curve and, beside it, every what-if SQNR
    of the manifest (one scalar series per layer x tensor x format over the 3 iterations) and
    the MX block-scale histograms with the manifest's counts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tensor_capture.tensorboard import tag_key

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    assert any(not t.startswith(("whatif/", "block_scale/")) for t in tags["scalars"])  # the loss
    recs = [r for r in schema.read_manifest(cap) if r.get(schema.META_WHATIF)]
    assert recs
    for r in recs:
        for fmt, numbers in r[schema.META_WHATIF]["formats"].items():
            series = acc.Scalars(f"whatif/{fmt}/sqnr_db/{tag_key(r)}")
            got = {e.step: e.value for e in series}
            if math.isfinite(numbers["sqnr_db"]):
                # TensorBoard keeps float32 scalars: one rounding
                assert got[r["iteration"]] == pytest.approx(numbers["sqnr_db"],
                                                            rel=UNIT_ROUNDOFF[torch.float32])
    r = next(r for r in recs if r["tensor_name"] == "input" and r["layer_idx"] == 0)
    hist = r[schema.META_WHATIF]["formats"]["mxfp8"]["block_scale"]["hist"]
    h = acc.Histograms(f"block_scale/mxfp8/{tag_key(r)}")
    assert {e.step for e in h} == {0, 1, 2}
    value = next(e for e in h if e.step == r["iteration"]).histogram_value
    assert list(value.bucket) == hist["counts"] and value.num == sum(hist["counts"])
    assert value.min >= hist["min_bin"]


def test_tiny_llama_unknown_whatif_format_fails_at_start(small_data, tmp_path, patched):
    from training_helpers import one_error_line, run

    from training_driver.megatron_env import free_port

    cmd = [sys.executable, "-m", "training_driver.train", "--data-path", small_data["data_path"],
           "--tokenizer", small_data["tokenizer"], "--model", "tiny", "--seq-length", "32",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    out = run(cmd, cwd=tmp_path, timeout=300, TENSOR_SAVE_ENABLED="true",
              TENSOR_SAVE_DIR=str(tmp_path / "cap"), TENSOR_SAVE_WHATIF_FORMATS="mxfp8,mxfp9",
              MEGATRON_LOWP_PATCHED_DIR=patched, MASTER_PORT=str(free_port()))
    assert out.returncode == 2
    line = one_error_line(out.stderr)
    assert "TENSOR_SAVE_WHATIF_FORMATS='mxfp9' is not a known format" in line and "nvfp4" in line
    assert not (tmp_path / "cap").exists() or not any((tmp_path / "cap").iterdir())


def test_whatif_budget_gate_keeps_numerics_within_a_share_of_wall_time():
    """WhatifGate with a hand-driven clock: the first iteration always; afterwards an iteration
    gets what-if numerics while the seconds charged are at most budget x elapsed."""
    from tensor_capture.whatif import WhatifGate

    now = [100.0]
    gate = WhatifGate(0.25, clock=lambda: now[0])
    assert gate.open(0) and gate.open(0)           # decided once per iteration
    gate.charge(2.0)                               # iteration 0 cost 2 s
    now[0] += 1.0
    assert not gate.open(1)                        # 2 s > 0.25 x 1 s
    now[0] += 6.0
    assert not gate.open(2)                        # 2 s > 0.25 x 7 s = 1.75 s
    now[0] += 1.0
    assert gate.open(3)                            # 2 s <= 0.25 x 8 s
    assert (gate.on, gate.skipped) == ([0, 3], [1, 2])
    unlimited = WhatifGate(None, clock=lambda: now[0])
    unlimited.charge(1e9)
    assert all(unlimited.open(i) for i in range(1, 4))


def test_whatif_budget_setting_and_the_stop_line(tmp_path):
    from tensor_capture import budget
    from tensor_capture.saver import TensorSaver

    assert load_config(env={}).whatif_budget == 0.1
    assert load_config(env={}, whatif_budget="unlimited").whatif_budget == math.inf
    for bad in ("0", "1.5", "lots"):
        with pytest.raises(ConfigError, match="whatif_budget") as err:
            load_config(env={}, whatif_budget=bad)
        assert "\n" not in str(err.value)
    saver = TensorSaver(enabled=True, save_dir=str(tmp_path), stats_only=True,
                        whatif_formats=("hifp8",), whatif_budget=0.01)
    saver.whatif_gate.charge(1e6)                  # as if the first iteration took forever
    for it in range(3):
        saver.save_tensor(_tensor((4, 32)), "linear", "forward", None, "input", 0,
                          phase="pre", component="linear", iteration=it, quant_axis=-1)
    saver.close()
    got = {r["iteration"]: schema.META_WHATIF in r for r in schema.read_manifest(tmp_path)}
    assert got == {0: True, 1: False, 2: False}    # statistics kept, what-if skipped
    assert "what-if numerics on 1 of 3 iteration(s), within whatif_budget=0.01" in \
        budget.stop_line(saver, 2, "done")
