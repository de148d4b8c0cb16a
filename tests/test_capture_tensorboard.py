"""What-if numerics to TensorBoard: read the event files back.

The driver run (Megatron's path, --tensorboard-dir) is checked in
tests/test_capture_numerics.py's 3-iteration tiny-Llama test; here the saver alone, its tags,
steps, micro-batch rule, histograms, and where the folder comes from.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch
from error_bounds import UNIT_ROUNDOFF

from quant.whatif import whatif
from tensor_capture import schema, tensorboard
from tensor_capture.saver import TensorSaver

EventAccumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator").EventAccumulator


def _events(folder):
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _capture(tmp_path, **kw):
    saver = TensorSaver(enabled=True, save_dir=str(tmp_path / "cap"), stats_only=True,
                        whatif_formats="mxfp8,hifp8", whatif_max_elements="unlimited",
                        whatif_budget="unlimited", **kw)
    g = torch.Generator().manual_seed(1)
    xs = {}
    for it in (0, 1):
        saver.set_iteration(it)
        for sample in (0, 1):                     # two micro-batches per iteration
            saver.set_sample_idx(sample)
            x = torch.randn(16, 64, generator=g) * (it + 1)
            xs[(it, sample)] = x
            saver.save_tensor(x, "linear", "forward", None, "input", 2, phase="pre",
                              component="linear", submodule="linear_fc1", quant_axis=-1)
    saver.close()
    return xs


def test_whatif_scalars_and_block_scale_histograms_are_read_back(tmp_path):
    xs = _capture(tmp_path, tensorboard_dir=str(tmp_path / "tb"))
    acc = _events(tmp_path / "tb")
    key = "L2.linear_fc1.forward.input"
    for fmt in ("mxfp8", "hifp8"):
        series = acc.Scalars(f"whatif/{fmt}/sqnr_db/{key}")
        assert [e.step for e in series] == [0, 1]          # the first micro-batch of each
        for e in series:
            want = whatif(xs[(e.step, 0)], fmt, -1)["sqnr_db"]
            assert e.value == pytest.approx(want, rel=UNIT_ROUNDOFF[torch.float32])   # float32
        for metric in tensorboard.SCALARS:
            assert acc.Scalars(f"whatif/{fmt}/{metric}/{key}")
    hist = whatif(xs[(1, 0)], "mxfp8", -1)["block_scale"]["hist"]
    value = acc.Histograms(f"block_scale/mxfp8/{key}")[-1].histogram_value
    assert list(value.bucket) == hist["counts"]
    assert list(value.bucket_limit) == [hist["min_bin"] + i + 0.5 for i in range(len(hist["counts"]))]
    assert value.num == sum(hist["counts"])
    assert not any(t.startswith("block_scale/hifp8") for t in acc.Tags()["histograms"])


def test_no_folder_no_events_and_megatron_args_give_the_folder(tmp_path, monkeypatch):
    _capture(tmp_path)                            # no folder anywhere: nothing written
    assert not list(tmp_path.rglob("events.out.tfevents.*"))
    # Megatron-LM's parsed arguments (megatron.training is not in megatron-core: a named
    # stand-in module holding what global_vars holds after parse_args)
    gv = types.ModuleType("megatron.training.global_vars")
    gv._GLOBAL_ARGS = types.SimpleNamespace(tensorboard_dir=str(tmp_path / "mtb"))
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    assert tensorboard.resolve_dir(None) == str(tmp_path / "mtb")
    assert tensorboard.resolve_dir("mine") == "mine"
    _capture(tmp_path / "again")
    assert _events(tmp_path / "mtb").Tags()["scalars"]


def test_ranks_get_a_prefix_only_in_a_multi_rank_world(tmp_path):
    board = tensorboard.NumericsBoard(str(tmp_path / "tb"))
    numbers = {"sqnr_db": 30.0, "rel_error": 0.01}
    for rank in (0, 1):
        board.log({"iteration": 4, "rank": rank, "world_size": 2, "layer_idx": None,
                   "layer_type": "linear", "operation": "backward", "tensor_name": "grad_output",
                   schema.META_WHATIF: {"formats": {"mxfp8": numbers, "nvfp4": {"error": "x"}}}})
    board.close()
    tags = _events(tmp_path / "tb").Tags()["scalars"]
    assert {t for t in tags if "sqnr" in t} == {
        f"whatif/mxfp8/sqnr_db/rank{r}/LNA.linear.backward.grad_output" for r in (0, 1)}
