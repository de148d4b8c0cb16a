"""One schema: every key a capture record carries is defined in tensor_capture/schema.py, and the
columnar index (tensor_viz.columnar) has a column for each, or names it as JSON-only.

The chain a new metadata key must follow: the saver writes it (tensor_capture.record) -> it is in
``schema.RECORD_KEYS`` -> the index has its column. Each link fails here when skipped.
"""
from __future__ import annotations

import pytest
import torch

from tensor_capture import schema
from tensor_capture.saver import TensorSaver

duckdb = pytest.importorskip("duckdb")
pads = pytest.importorskip("pyarrow.dataset")

from tensor_viz import columnar  # noqa: E402


def _full_record(directory) -> dict:
    """One real record holding every key the saver can write: an emulated linear operand
    (recipe, recipe specs, quantization analysis along its GEMM axis), what-if numerics, a
    metadata extra (the attention-probabilities sample description, the debug API's names) and
    the statistics."""
    saver = TensorSaver(enabled=True, save_dir=str(directory), quant_type="mxfp8",
                        whatif_formats="mxfp8", whatif_budget="unlimited")
    saver.set_iteration(2)
    site = schema.CaptureSite(layer_type="linear", operation="forward", phase="pre",
                              tensor_name="input", component="linear", layer_idx=1,
                              module_path="decoder.layers.1.mlp.linear_fc1",
                              submodule="linear_fc1")
    probs = {"heads": [0, 2], "head_count": 4, "row_stride": 2, "shape": [8, 16, 16]}
    assert saver.capture(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)), site,
                         sample_idx=0, quant_axis=-1,
                         metadata={schema.META_PROBS_SAMPLE: probs,
                                   schema.META_DEBUG_API: {"namespace": "lowp",
                                                           "tensor": "activation"}})
    saver.close()
    (record,) = schema.read_manifest(directory)
    return record


def test_the_saver_writes_only_keys_the_schema_defines(tmp_path):
    record = _full_record(tmp_path)
    assert set(record) <= set(schema.RECORD_KEYS), set(record) - set(schema.RECORD_KEYS)
    assert set(record) == set(schema.RECORD_KEYS)      # the record above really has them all
    assert set(record[schema.META_STATS]) == {*schema.STAT_KEYS, schema.STAT_RANGE,
                                              schema.STAT_LOG2_HIST}


def test_every_schema_key_has_an_index_column_or_a_reason():
    indexed = set(columnar.RECORD_STRUCTURE)
    missing = [k for k in schema.RECORD_KEYS if k not in indexed and k not in columnar.JSON_ONLY]
    assert not missing, f"record keys with no column in tensor_viz.columnar: {missing}"
    assert set(columnar.JSON_ONLY) <= set(schema.RECORD_KEYS)   # no stale exemption
    assert not indexed - set(schema.RECORD_KEYS)                  # no column without a key
    stats = columnar.RECORD_STRUCTURE[schema.META_STATS]
    assert set(stats) == {*schema.STAT_KEYS, schema.STAT_RANGE, schema.STAT_LOG2_HIST}
    assert {k for k in schema.STAT_KEYS if stats[k] == "BIGINT"} == set(schema.STAT_COUNT_KEYS)


def test_a_record_with_every_schema_key_lands_in_the_parquet_index(tmp_path):
    record = _full_record(tmp_path / "cap")
    state = columnar.refresh(tmp_path / "cap")
    assert state.records == 1 and state.bad_lines == 0
    table = pads.dataset(state.data_dir, format="parquet", partitioning="hive").to_table()
    columns = set(table.column_names)
    missing = [k for k in schema.RECORD_KEYS if k not in columns and k not in columnar.JSON_ONLY]
    assert not missing, f"record keys with no Parquet column: {missing}"
    row = table.to_pylist()[0]
    for key in schema.NAME_FIELDS + (schema.META_MODULE_PATH, schema.META_VARIANT,
                                     schema.META_RECIPE, schema.META_SHAPE):
        assert row[key] == record[key], key
    stats = row[schema.META_STATS]
    assert all(stats[k] == record[schema.META_STATS][k] for k in schema.STAT_KEYS)
    assert row[schema.META_PROBS_SAMPLE] == record[schema.META_PROBS_SAMPLE]
    assert [name for name, _ in row[schema.META_WHATIF][schema.WHATIF_FORMATS]] == ["mxfp8"]


def test_nested_keys_of_a_record_survive_into_the_index(tmp_path):
    """The statistics' range entries, the quantization analysis and each what-if format are typed
    structs in the index: a key the record gains there must gain its field, or DuckDB would drop
    it without a word."""
    record = _full_record(tmp_path / "cap")
    state = columnar.refresh(tmp_path / "cap")
    row = pads.dataset(state.data_dir, format="parquet", partitioning="hive").to_table().to_pylist()[0]

    def entries(mapping):        # a DuckDB MAP reads back as [(key, value), ...]
        return dict(mapping) if isinstance(mapping, list) else mapping

    nested = [  # (as written, as indexed, keys left in the JSON on purpose)
        (record[schema.META_STATS][schema.STAT_RANGE], row[schema.META_STATS][schema.STAT_RANGE],
         ()),
        (record[schema.META_QUANT_ANALYSIS], row[schema.META_QUANT_ANALYSIS],
         columnar.ANALYSIS_JSON_ONLY),
        (record[schema.META_WHATIF][schema.WHATIF_FORMATS],
         row[schema.META_WHATIF][schema.WHATIF_FORMATS], ()),
    ]
    for written, indexed, json_only in nested:
        indexed = entries(indexed)
        assert written and set(written) == set(indexed)
        for fmt, fields in written.items():
            lost = set(fields) - set(indexed[fmt]) - set(json_only)
            assert not lost, f"{fmt}: keys with no field in tensor_viz.columnar: {sorted(lost)}"
            assert set(json_only) <= set(fields), "a JSON-only key the record no longer has"
