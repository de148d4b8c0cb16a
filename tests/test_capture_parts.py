"""TensorSaver's parts on their own: the policy decides without a disk, the record builder builds
without a policy, the sink turns saving off with one message."""
from __future__ import annotations

import torch

from tensor_capture import schema
from tensor_capture.config import load_config
from tensor_capture.policy import CapturePolicy
from tensor_capture.record import RecordBuilder
from tensor_capture.sink import CaptureSink


def _config(tmp_path, **kw):
    return load_config(env={}, enabled=True, save_dir=str(tmp_path), **kw)


def test_policy_selects_books_and_budgets_without_touching_the_disk(tmp_path):
    warned = []
    p = CapturePolicy(_config(tmp_path / "never", iter_every=2, module_regex=r"fc1$", max_rows=4,
                              byte_budget=100, min_iterations=1),
                      lambda key, msg: warned.append(key))
    assert [p.iteration_selected(i) for i in range(4)] == [True, False, True, False]
    assert p.wants("linear", "forward", "pre", "input", 0, "decoder.layers.0.mlp.linear_fc1")
    assert not p.wants("linear", "forward", "pre", "input", 0, "decoder.layers.0.mlp.linear_fc2")
    x = torch.arange(40.0).reshape(10, 4)
    keep, kept, rows, stride, nbytes = p.file_plan(x, 0)     # 4 rows of 4 floats: 64 B
    assert keep and rows == 4 and stride == 3 and nbytes == 64 and torch.equal(kept, x[::3])
    assert p.book(0, nbytes) == 1 and p.bytes == 64 and p.saved_iters == {0}
    p.book(0, 0)
    assert p.file_plan(x, 2)[0] is False and warned == ["budget"]   # 64 + 64 > 100
    assert p.book(2, 0) == 3 and p.bytes == 64 and p.saved_iters == {0, 2}
    assert not (tmp_path / "never").exists()
    assert CapturePolicy(_config(tmp_path, stats_only=True), print).file_plan(x, 0)[::4] == (False, 0)


def test_record_builder_names_and_stages_a_record(tmp_path):
    b = RecordBuilder(_config(tmp_path, quant_type="mxfp8", range_formats=["hifp8"]))
    x = torch.randn(8, 64)
    ranges = b.ranges(x.dtype)
    assert [r.name for r in ranges] == ["float32", "hifp8"] and b.ranges(x.dtype) is ranges
    name = schema.TensorName(layer_type="linear", operation="forward", tensor_name="input",
                             quant_type="mxfp8", layer_idx=0, phase="pre", component="linear",
                             iteration=1, rank=0, sample_idx=None, timestamp=b.timestamp(),
                             counter=1)
    info = {"rank": 0, "tp_rank": None, "pp_rank": None, "dp_rank": None, "world_size": 1}
    site = schema.CaptureSite(layer_type="linear", operation="forward", phase="pre",
                              tensor_name="input", component="linear", layer_idx=0,
                              module_path="m.fc1", submodule="fc1", variant="hp")
    meta = b.metadata(name, site, x, info, sampled_rows=None, row_stride=None, quant_axis=-1,
                      extra={"extra": 1})
    assert meta["iteration"] == 1 and meta["shape"] == [8, 64] and meta["extra"] == 1
    assert meta["quant_analysis"]["mxfp8"]["axis"] == -1 and meta["emulated_format"] == "mxfp8"
    item = b.build(tmp_path, 0, "f.pt", x, kept=x, sampled=False, stats_vec=None, ranges=ranges,
                   meta=meta)
    assert item.stats_vec is None and torch.equal(item.stats_src, x)     # stats on the writer
    assert item.tensor is item.stats_src and item.stats_src.data_ptr() != x.data_ptr()


def test_sink_failure_is_one_message_and_tells_the_owner(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    told = []
    sink = CaptureSink(tmp_path / "file" / "sub", 4, on_failure=lambda: told.append(1))
    assert sink.writer() is None and sink.writer() is None and not sink.submit(None)
    assert told == [1] and "cannot write to" in sink.failed
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_probs_sample_keeps_spread_heads_strided_rows_and_every_key():
    from tensor_capture.hooks import probs_sample

    b, heads, sq, sk = 3, 8, 100, 40
    probs = torch.randn(b * heads, sq, sk)
    part, info = probs_sample(probs, heads, 3, 32)
    assert info["heads"] == [0, 2, 5] and info["head_count"] == heads
    assert info["row_stride"] == 4 and info["shape"] == [b * heads, sq, sk]
    assert torch.equal(part, probs[[0, 2, 5], ::4])          # rows 0, 4, ..., 96: 25 <= 32
    assert part.shape == (3, 25, sk)
    # more heads asked than exist, unknown head count (the first dim is used), short sequence
    part, info = probs_sample(probs[:2, :5], None, 4, 256)
    assert info["heads"] == [0, 1] and info["row_stride"] == 1 and part.shape == (2, 5, sk)
    # evenly spaced heads (the usual case): a view of probs, no copy, the same values
    part, info = probs_sample(probs, heads, 4, 32)
    assert info["heads"] == [0, 2, 4, 6] and torch.equal(part, probs[[0, 2, 4, 6], ::4])
    assert part.untyped_storage().data_ptr() == probs.untyped_storage().data_ptr()
