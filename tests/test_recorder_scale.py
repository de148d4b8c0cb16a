"""Reading a flight recorder's summaries at scale (issue 52 item 3): every summary file is one
Parquet row group whose footer statistics let a reader skip it, and the DuckDB connection
lowp-diagnose reads them with spills beyond its memory limit into a folder of its own.
The peak memory at 1x and 4x rows is measured by bench/bench_recorder_scale.py (no timed or
memory-sized test here: the machine is shared)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tensor_capture import schema
from tensor_capture.recorder.out import write_summary_table


def _table(rank: int, first: int, iterations: int, sites: int, nan_at: int | None) -> pa.Table:
    n = iterations * sites
    it = np.repeat(np.arange(first, first + iterations), sites)
    site = np.tile(np.arange(sites), iterations)
    cols = {"iteration": it, "rank": np.full(n, rank), "site": site,
            "module_path": [f"decoder.layers.{s}.mlp" for s in site], "layer_type": ["linear"] * n,
            "layer_idx": site, "operation": ["forward"] * n, "phase": ["pre"] * n,
            "tensor_name": ["input"] * n, "variant": ["hp"] * n, "quant_type": ["bf16"] * n,
            "micro_batches": np.full(n, 2), "count": np.full(n, 64), "sum": np.ones(n),
            "sumsq": np.full(n, 64.0), "min": np.full(n, -1.0), "max": np.full(n, 1.0),
            "nan_count": ((it == nan_at) & (site == 1)).astype(np.int64),
            "inf_count": np.zeros(n, np.int64), "flush_count": np.zeros(n, np.int64),
            "saturation_count": np.zeros(n, np.int64)}
    assert list(cols) == list(schema.REC_SUMMARY_COLUMNS)
    return pa.table(cols)


def _folder(tmp_path, ranks=3, files=4, every=5, sites=4, nan_at=12):
    rec = tmp_path / schema.RECORDER_DIR
    for r in range(ranks):
        for k in range(files):
            write_summary_table(_table(r, k * every, every, sites, nan_at if r == 1 else None),
                                rec / schema.recorder_summary_name(r, k * every))
    return tmp_path


def test_a_summary_file_is_one_row_group_whose_footer_bounds_iteration_and_nan_count(tmp_path):
    folder = _folder(tmp_path)
    seen = {}
    for f in sorted((folder / schema.RECORDER_DIR).glob(schema.RECORDER_SUMMARY_GLOB)):
        meta = pq.ParquetFile(f).metadata
        assert meta.num_row_groups == 1
        stats = {meta.schema.column(i).name: meta.row_group(0).column(i).statistics
                 for i in range(meta.num_columns)}
        rows = pq.read_table(f).to_pydict()
        for key in ("iteration", "nan_count", "inf_count"):
            assert stats[key].has_min_max, (f.name, key)
            assert (stats[key].min, stats[key].max) == (min(rows[key]), max(rows[key]))
        seen[f.name] = stats["nan_count"].max
    # only the file that holds the NaN may be read by a query for nan_count > 0
    assert [n for n, m in seen.items() if m > 0] == [schema.recorder_summary_name(1, 10)]


def test_the_narrow_table_of_summaries_spills_into_a_folder_of_its_own(tmp_path, monkeypatch):
    import os
    import tempfile

    from tensor_viz import columnar
    from tensor_viz.diagnose import recorder_view
    from tensor_viz.diagnose.rules import NARROW

    folder = _folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    con = columnar.connect(memory_limit="64MB")
    rows = recorder_view.narrow_from_summaries(con, NARROW, folder)
    assert rows == 3 * 4 * 5 * 4
    assert con.execute(f"SELECT rank, iteration, module_path FROM {NARROW} "
                       "WHERE nan_count > 0").fetchall() == [(1, 12, "decoder.layers.1.mlp")]
    # beyond its memory_limit DuckDB writes temporary blocks: under the system's temporary
    # folder, one per connection, never the working directory (DuckDB's default: .tmp there)
    con.execute("CREATE TEMP TABLE big AS SELECT range AS a, random() AS b FROM range(8000000)")
    spill = con.execute("SELECT current_setting('temp_directory')").fetchone()[0]
    assert os.path.dirname(spill) == tempfile.gettempdir() and os.listdir(spill)
    assert not (tmp_path / ".tmp").exists()
    assert spill != columnar.connect().execute(
        "SELECT current_setting('temp_directory')").fetchone()[0]
    con.close()
    assert not os.path.exists(spill)
