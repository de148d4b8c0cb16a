"""The flight recorder's rollup tiers (issue 52 item 4): recent iterations at full resolution,
older ones merged into coarser tiers by the writer, exactly.

The recorder runs for real on megatron-core's schedule interface (tensor_capture.numbering
.wrap_schedule over a schedule of our own), twice on the same data: rolled up (a few iterations
kept whole) and not (every iteration kept). The captured values are multiples of 1/8 below 8, so
every sum, sum of squares and merge of them is exact in float32 and float64 whatever the order:
each tier row must equal the full-resolution rows of its span merged, bit for bit. Diagnosis on
the rolled-up summaries alone finds a NaN planted in the old part at its tier row's span and one
in the recent part at its iteration, and a drift over the whole run.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from tensor_capture import numbering, schema
from tensor_capture import saver as ts
from tensor_capture.recorder import read as recorder_read
from tensor_capture.recorder.out import (
    ROLLUP_FACTOR,
    merge_spans,
    rollup,
    summary_file,
    write_summary_table,
)

SITES, MICRO, EVERY, KEEP, ITERATIONS = 3, 2, 2, 4, 260
DRIFT_SITE = 1
LAST = schema.REC_LAST_ITERATION


def _site(i: int) -> schema.CaptureSite:
    return schema.CaptureSite(layer_type="linear", operation="forward", phase="pre",
                              tensor_name=f"t{i}", module_path=f"decoder.layers.{i}.mlp",
                              layer_idx=i, component="linear")


def _record(folder, keep: int, nan_at: int, smooth: bool = False) -> None:
    """ITERATIONS iterations of the recorder; site DRIFT_SITE's values double every 32
    iterations (``smooth``: grow by 2% each iteration, no longer multiples of 1/8); a NaN in
    micro-batch 1 of site 2 at ``nan_at``."""
    ts.configure(enabled=True, save_dir=str(folder), mode="recorder", recorder_window=2,
                 recorder_trigger_iterations=1, recorder_summary_every=EVERY,
                 recorder_warmup=3, recorder_full_iterations=keep, stats_only=True)
    g = torch.Generator().manual_seed(0)

    def forward_step(data_iterator, model):
        saver = ts.get_tensor_saver()
        it, mb = saver.iteration, saver.sample_idx
        for i in range(SITES):
            x = torch.randint(-63, 64, (256,), generator=g).float() / 8
            if i == DRIFT_SITE:
                x = x * (1.02 ** it if smooth else 2.0 ** (it // 32))
            if (it, mb, i) == (nan_at, 1, 2):
                x[17] = float("nan")
            saver.capture(x, _site(i))
        return 1.0

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches,
                 forward_only=False):
        return [forward_step_func(data_iterator, model) for _ in range(num_microbatches)]

    step = numbering.wrap_schedule(schedule)
    try:
        for _ in range(ITERATIONS):
            step(forward_step_func=forward_step, data_iterator=None, model=[None],
                 num_microbatches=MICRO)
        ts.get_tensor_saver().close()
    finally:
        ts.reset_tensor_saver()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollup")
    out = {}
    for name, keep, nan_at, smooth in (("full", 10**9, 30, False), ("rolled", KEEP, 30, False),
                                       ("recent", KEEP, ITERATIONS - 3, True)):
        _record(root / name, keep, nan_at, smooth)
        out[name] = root / name
    return out


def _rows(folder) -> list[dict]:
    cols = [*schema.REC_SUMMARY_COLUMNS]
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for f in recorder_read.summary_files(folder):
        t = pq.read_table(f)
        last = t[LAST] if LAST in t.column_names else t["iteration"]
        tables.append(t.select(cols).append_column(LAST, pa.array(last.to_numpy())))
    return pa.concat_tables(tables).to_pylist()


def test_the_writer_rolls_old_iterations_into_tiers_and_keeps_the_recent_ones(runs):
    tiers = {}
    for f in recorder_read.summary_files(runs["rolled"]):
        s = summary_file(f)
        tiers.setdefault(s.tier, []).append(s)
    assert set(tiers) == {0, 1, 2}, tiers
    rows = _rows(runs["rolled"])
    latest = max(r[LAST] for r in rows)
    # the last KEEP iterations are whole (their rows span one iteration); a tier's row spans at
    # most ROLLUP_FACTOR**tier iterations
    for r in rows:
        if r["iteration"] > latest - KEEP:
            assert r[LAST] == r["iteration"]
    for tier, files in tiers.items():
        for s in files:
            import pyarrow.parquet as pq

            t = pq.read_table(s.path).to_pylist()
            assert all(r.get(LAST, r["iteration"]) - r["iteration"] < ROLLUP_FACTOR ** tier
                       for r in t)
    # far fewer rows than iterations, every site's iterations covered once, in order
    assert len(rows) < len(_rows(runs["full"])) / 4
    for site in range(SITES):
        spans = sorted((r["iteration"], r[LAST]) for r in rows if r["site"] == site)
        covered = [it for a, b in spans for it in range(a, b + 1)]
        assert covered == list(range(ITERATIONS)), site


def test_each_tier_row_equals_its_full_resolution_rows_merged_exactly(runs):
    full = _rows(runs["full"])
    by_site: dict[int, list[dict]] = {}
    for r in full:
        by_site.setdefault(r["site"], []).append(r)
    checked, widest = 0, 0
    for t in _rows(runs["rolled"]):
        span = [r for r in by_site[t["site"]] if t["iteration"] <= r["iteration"] <= t[LAST]]
        assert len(span) == t[LAST] - t["iteration"] + 1
        for key in ("micro_batches", *schema.REC_MERGE):
            how = {"sum": sum, "min": min, "max": max}[schema.REC_MERGE.get(key, "sum")]
            assert t[key] == how(r[key] for r in span), (key, t["iteration"], t[LAST])
        assert {k: t[k] for k in schema.REC_SITE_KEYS} == {k: span[0][k]
                                                           for k in schema.REC_SITE_KEYS}
        checked += len(span) > 1
        widest = max(widest, len(span))
    # tier rows of every site, tier 2's (spans over ROLLUP_FACTOR iterations) among them
    assert checked >= 2 * SITES and widest > ROLLUP_FACTOR


def test_a_crash_between_the_tier_file_and_the_removal_neither_loses_nor_doubles(runs, tmp_path):
    folder = tmp_path / "crash"
    rec = folder / schema.RECORDER_DIR
    shutil.copytree(runs["full"] / schema.RECORDER_DIR, rec)
    files = [summary_file(f) for f in rec.glob(schema.RECORDER_SUMMARY_GLOB)]
    files = sorted(files, key=lambda s: s.first)[:ROLLUP_FACTOR]
    import pyarrow as pa
    import pyarrow.parquet as pq

    merged = merge_spans(pa.concat_tables([pq.read_table(s.path) for s in files]),
                         ROLLUP_FACTOR)
    # the tier file written, the finer files not yet removed (the writer stopped in between)
    write_summary_table(merged, rec / schema.recorder_tier_name(0, files[0].first,
                                                                files[-1].last, 1))
    assert all(s.path.exists() for s in files)
    read = recorder_read.read_summaries(folder)
    whole = recorder_read.read_summaries(runs["full"])
    assert read.num_rows < whole.num_rows
    for key in ("count", "nan_count", "sum"):
        assert sum(read[key].to_pylist()) == sum(whole[key].to_pylist()), key
    # the next rollup finds the same files aged out and finishes the job
    rollup(rec, 0, files[-1].last + 10**6, KEEP)
    assert not any(s.path.exists() for s in files)


def _summaries_only(run, tmp_path):
    only = tmp_path / "only"
    shutil.copytree(run / schema.RECORDER_DIR, only / schema.RECORDER_DIR)
    return only


def test_diagnosis_finds_an_old_nan_at_its_tier_span(runs, tmp_path):
    from tensor_viz.diagnose import diagnose

    result = diagnose(_summaries_only(runs["rolled"], tmp_path))
    first = next(f.to_dict() for f in result.findings if f.kind == "first_nonfinite")
    row = next(r for r in _rows(runs["rolled"]) if r["nan_count"] and r["site"] == 2)
    assert (first["iteration"], first["module_path"]) == (row["iteration"], _site(2).module_path)
    assert row["iteration"] <= 30 <= row[LAST] and row[LAST] > row["iteration"]


def test_diagnosis_finds_a_recent_nan_at_its_iteration_and_the_drift_over_the_tiers(
        runs, tmp_path):
    from tensor_viz.diagnose import diagnose

    result = diagnose(_summaries_only(runs["recent"], tmp_path))
    first = next(f.to_dict() for f in result.findings if f.kind == "first_nonfinite")
    assert (first["iteration"], first["module_path"]) == (ITERATIONS - 3, _site(2).module_path)
    # the drift is seen over the whole run: its first row is a tier's, from iteration 0
    drift = [f.to_dict() for f in result.findings if f.kind == "range_drift"]
    assert [(d["module_path"], d["iteration"]) for d in drift] == [
        (_site(DRIFT_SITE).module_path, 0)]


def test_the_setting_has_a_default_and_refuses_a_bad_value(tmp_path):
    from tensor_capture.config import ConfigError, load_config

    cfg = tmp_path / "rec.yaml"
    cfg.write_text("mode: recorder\nrecorder_full_iterations: 0\n")
    with pytest.raises(ConfigError, match="recorder_full_iterations=0 must be >= 1"):
        load_config(cfg, env={})
    cfg.write_text("mode: recorder\nrecorder_full_iterations: 250\n")
    assert load_config(cfg, env={}).recorder_full_iterations == 250
    assert load_config(env={}).recorder_full_iterations == 1000
