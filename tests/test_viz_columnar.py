"""The columnar index of the manifests: every record counted, bad lines counted and
named, incremental refresh, rebuilds, a second reader, outlier ranks, numerics.csv by DuckDB.

The captures are written by the real TensorSaver (stats-only, what-if numerics on) as several
ranks would write them; one rank is made to diverge, so the outlier table has a known answer.
"""
from __future__ import annotations

import csv
import json
import math

import pytest
import torch

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from tensor_capture import schema
from tensor_capture.saver import TensorSaver
from tensor_viz import columnar, rank_tables

RANKS, ITERATIONS, DIVERGES_AT, BAD_RANK = 5, 6, 3, 2


def _capture(directory, ranks=RANKS, iterations=ITERATIONS, whatif=True):
    """Stats-only records of 3 tensors per iteration per rank; rank BAD_RANK's values x50 from
    iteration DIVERGES_AT."""
    saver = TensorSaver(enabled=True, save_dir=str(directory), stats_only=True,
                        whatif_formats="mxfp8,hifp8" if whatif else "none",
                        whatif_budget="unlimited", max_iterations="unlimited")
    for it in range(iterations):
        for rank in range(ranks):
            g = torch.Generator().manual_seed(100 * it + rank)
            for name, layer in (("input", 0), ("weight", 0), ("input", 1)):
                x = torch.randn(16, 64, generator=g)
                if rank == BAD_RANK and it >= DIVERGES_AT:
                    x = x * 50
                saver.save_tensor(x, "linear", "forward", None, name, layer, phase="pre",
                                  component="linear",
                                  rank=rank, iteration=it, submodule="linear_fc1", quant_axis=-1)
    saver.close()
    return ranks * iterations * 3


def test_every_record_is_counted_and_a_second_reader_agrees(tmp_path):
    import pyarrow.dataset as pads

    n = _capture(tmp_path / "cap")
    state = columnar.refresh(tmp_path / "cap")
    assert state.records == n and state.bad_lines == 0 and state.manifests == RANKS
    con = columnar.connect()
    head = rank_tables.header(con, state)
    assert (head.records, head.ranks, head.iterations) == (n, RANKS, ITERATIONS)
    # pyarrow reads the same dataset with no conversion: counts and one aggregate agree
    table = pads.dataset(state.data_dir, format="parquet", partitioning="hive").to_table()
    assert table.num_rows == n
    absmax = max(r["absmax"] for r in table.column("stats").to_pylist())
    want = max(json.loads(line)["stats"]["absmax"]
               for p in (tmp_path / "cap").glob(schema.MANIFEST_GLOB)
               for line in p.read_text().splitlines())
    assert absmax == want
    assert sorted(set(table.column("rank").to_pylist())) == list(range(RANKS))
    # one rank reads alone: its own partition folder
    one = pads.dataset(state.data_dir / "rank=1", format="parquet").to_table()
    assert one.num_rows == n // RANKS


def test_torn_and_foreign_lines_are_counted_named_and_skipped(tmp_path):
    n = _capture(tmp_path / "cap", ranks=2, iterations=2)
    m0 = tmp_path / "cap" / "manifest_rank0.jsonl"
    lines = m0.read_text().splitlines(keepends=True)
    # a rank killed mid-line, then restarted and appending again; a foreign JSON line; a blank
    m0.write_text("".join(lines[:2]) + '{"layer_type": "linear", "tru' + "".join(lines[2:3])
                  + '{"hello": 1}\n' + "\n" + "".join(lines[3:]))
    m1 = tmp_path / "cap" / "manifest_rank1.jsonl"
    with open(m1, "a") as fh:
        fh.write('{"layer_type": "linear", "still writing')     # no newline yet: pending
    state = columnar.refresh(tmp_path / "cap")
    assert state.records == n - 1          # the record glued to the torn line is lost with it
    assert state.bad_lines == 2 and state.pending_bytes == len('{"layer_type": "linear", "still writing')
    assert state.bad_examples[0].startswith("manifest_rank0.jsonl:3: not JSON")
    assert state.bad_examples[1] == "manifest_rank0.jsonl:4: not a capture record"
    line = rank_tables.header(columnar.connect(), state).line()
    assert f"{n - 1:,} records" in line and "2 bad line(s) skipped" in line
    assert "manifest_rank0.jsonl:3" in line


def test_refresh_reads_only_what_was_appended(tmp_path):
    n = _capture(tmp_path / "cap", ranks=3, iterations=2)
    first = columnar.refresh(tmp_path / "cap")
    assert first.new_records == n
    again = columnar.refresh(tmp_path / "cap")
    assert (again.records, again.new_records) == (n, 0)
    parts = sorted(p.name for p in first.data_dir.rglob("*.parquet"))
    # a running job appends: only the new lines are parsed, into new parts
    m = tmp_path / "cap" / "manifest_rank0.jsonl"
    extra = m.read_text().splitlines(keepends=True)[:4]
    with open(m, "a") as fh:
        fh.write("".join(extra))
    third = columnar.refresh(tmp_path / "cap")
    assert (third.records, third.new_records) == (n + 4, 4)
    assert set(parts) < {p.name for p in third.data_dir.rglob("*.parquet")}
    assert rank_tables.header(columnar.connect(), third).records == n + 4


def test_an_index_of_another_version_or_a_rewritten_manifest_is_rebuilt(tmp_path):
    n = _capture(tmp_path / "cap", ranks=2, iterations=2)
    state = columnar.refresh(tmp_path / "cap")
    state_file = state.cache_dir / columnar.STATE_FILE
    data = json.loads(state_file.read_text())
    state_file.write_text(json.dumps(dict(data, index_version=columnar.INDEX_VERSION - 1)))
    again = columnar.refresh(tmp_path / "cap")
    assert again.rebuilt == "an index of another version" and again.records == n
    m = tmp_path / "cap" / "manifest_rank1.jsonl"
    m.write_text("".join(m.read_text().splitlines(keepends=True)[:2]))   # replaced, shorter
    third = columnar.refresh(tmp_path / "cap")
    assert "manifest_rank1.jsonl" in third.rebuilt and third.records == n // 2 + 2


def test_a_capture_folder_that_cannot_be_written_gets_its_index_elsewhere(tmp_path, monkeypatch):
    _capture(tmp_path / "cap", ranks=1, iterations=1)
    real = columnar._writable
    monkeypatch.setattr(columnar, "_writable",
                        lambda folder: False if folder.parent == tmp_path / "cap" else real(folder))
    said = []
    state = columnar.refresh(tmp_path / "cap", say=said.append)
    assert state.cache_dir.parent != tmp_path / "cap" and state.records == 3
    assert len(said) == 1 and "read-only" in said[0] and str(state.cache_dir) in said[0]
    mine = columnar.refresh(tmp_path / "cap", cache_dir=tmp_path / "idx")
    assert mine.cache_dir == tmp_path / "idx" and mine.records == 3


def test_outlier_ranks_name_the_rank_and_the_iteration_it_diverged(tmp_path):
    _capture(tmp_path / "cap")
    state = columnar.refresh(tmp_path / "cap")
    con = columnar.connect()
    view = rank_tables.rank_view(con, state)
    absmax = [r for r in view.outliers if r["metric"] == "absmax"]
    assert [r["rank"] for r in absmax] == [BAD_RANK]
    assert absmax[0]["first_iteration"] == DIVERGES_AT
    assert absmax[0]["cells"] == 3 * (ITERATIONS - DIVERGES_AT)
    # re-derived: rank BAD_RANK's absmax of the worst cell against the median of the others
    w = absmax[0]
    vals = []
    for p in (tmp_path / "cap").glob(schema.MANIFEST_GLOB):
        for line in p.read_text().splitlines():
            r = json.loads(line)
            if (r["iteration"], r["layer_idx"], r["tensor_name"]) == (
                    w["iteration"], w["layer_idx"], w["tensor_name"]):
                vals.append((r["rank"], r["stats"]["absmax"]))
    vals.sort()
    assert w["v"] == dict(vals)[BAD_RANK]
    assert w["med"] == sorted(v for _, v in vals)[len(vals) // 2]
    band = rank_tables.band(con, state, "absmax", w, BAD_RANK)
    assert [b[0] for b in band] == list(range(ITERATIONS))
    assert all((b[4] == b[3]) == (b[0] >= DIVERGES_AT) for b in band)   # it is the max from then


def test_numerics_csv_from_duckdb_equals_the_python_path(tmp_path):
    from tensor_viz import numerics_csv
    from tensor_viz.catalog import scan

    _capture(tmp_path / "cap", ranks=2, iterations=2)
    (tmp_path / "py").mkdir()
    (tmp_path / "db").mkdir()
    numerics_csv.write_csv(scan(tmp_path / "cap").entries, tmp_path / "py")
    state = columnar.refresh(tmp_path / "cap")
    rows = rank_tables.write_numerics_csv(columnar.connect(), state, tmp_path / "db",
                                          numerics_csv.COLUMNS)

    def read(p):
        with open(p / "numerics.csv", newline="") as fh:
            r = csv.DictReader(fh)
            assert tuple(r.fieldnames) == numerics_csv.COLUMNS
            return sorted(tuple(_norm(v) for v in row.values()) for row in r)

    py, db = read(tmp_path / "py"), read(tmp_path / "db")
    assert rows == len(py) == 2 * 2 * 3 * 2
    assert py == db


def _norm(v: str):
    try:
        f = float(v)
    except ValueError:
        return v.lower()
    return round(f, 9) if math.isfinite(f) else str(f)


def test_the_report_of_a_large_capture_covers_every_record(tmp_path):
    from tensor_viz import pipeline
    from tensor_viz.options import Options

    n = _capture(tmp_path / "cap")
    result = pipeline.build(tmp_path / "cap", tmp_path / "draw", sections=("rank_analysis",),
                            opts=Options(max_records=20, selection_records=30, progress=False,
                                         workers=1))
    html = (tmp_path / "draw" / "index.html").read_text()
    assert f"Capture: {n:,} records from {RANKS} manifest(s)" in html
    assert "Large capture: figures drawn per record use" in html
    assert len(result.catalog.entries) <= 30
    assert {e.name.rank for e in result.catalog.entries} >= {0, BAD_RANK}
    assert f"<tr><td>{BAD_RANK}</td><td>absmax</td><td>{DIVERGES_AT}</td>" in html
    assert (tmp_path / "draw" / "rank_analysis" / "rank_outliers.png").is_file()
    assert [f.layout_issues for f in result.figures.figures if f.layout_issues] == []   # legends off the data
    with open(tmp_path / "draw" / "numerics.csv", newline="") as fh:
        assert sum(1 for _ in csv.DictReader(fh)) == n * 2       # every record, two formats


def test_the_index_folder_is_not_taken_for_capture_files(tmp_path):
    from tensor_viz.catalog import scan

    _capture(tmp_path / "cap", ranks=2, iterations=1)
    before = scan(tmp_path / "cap")
    columnar.refresh(tmp_path / "cap")
    after = scan(tmp_path / "cap")
    assert (after.ignored, len(after.problems)) == (before.ignored, len(before.problems))


def test_a_report_with_nothing_new_is_not_drawn_again(tmp_path):
    from tensor_viz import pipeline
    from tensor_viz.options import Options
    from tensor_viz.report_stamp import STAMP_FILE

    _capture(tmp_path / "cap", ranks=3, iterations=2)
    opts = Options(progress=False, workers=1)
    first = pipeline.build(tmp_path / "cap", tmp_path / "draw", sections=("statistics",), opts=opts)
    assert first.reused is None and first.drawn > 0
    mtime = (tmp_path / "draw" / "index.html").stat().st_mtime_ns
    again = pipeline.build(tmp_path / "cap", tmp_path / "draw", sections=("statistics",), opts=opts)
    assert again.reused is not None and again.drawn == first.drawn and again.exit_code == 0
    assert (tmp_path / "draw" / "index.html").stat().st_mtime_ns == mtime
    # other sections, or a grown manifest: drawn again
    other = pipeline.build(tmp_path / "cap", tmp_path / "draw", sections=("distributions",), opts=opts)
    assert other.reused is None
    m = tmp_path / "cap" / "manifest_rank0.jsonl"
    with open(m, "a") as fh:
        fh.write(m.read_text().splitlines(keepends=True)[0])
    grown = pipeline.build(tmp_path / "cap", tmp_path / "draw", sections=("distributions",), opts=opts)
    assert grown.reused is None and "19 records" in (tmp_path / "draw" / "index.html").read_text()
    (tmp_path / "draw" / STAMP_FILE).unlink()
    assert pipeline.build(tmp_path / "cap", tmp_path / "draw", sections=("distributions",),
                          opts=opts).reused is None
