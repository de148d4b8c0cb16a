"""gradient_accumulation_fusion and LinearWithFrozenWeight on real megatron-core 0.16.1 layers.

ColumnParallelLinear -> RowParallelLinear (patched copy), two micro-batches, with a pure-torch
stand-in for apex's fused_weight_gradient_mlp_cuda (capture_runtime_helpers.ApexWgradStandIn)
and a float32 main_grad on each weight.
"""
from __future__ import annotations

import pytest
import torch
from capture_runtime_helpers import fusion_worker, run_worker

from tensor_capture import schema
from tensor_capture.patcher import prepare_patched_megatron


@pytest.fixture(scope="module")
def fusion(tmp_path_factory):
    patched = str(prepare_patched_megatron(tmp_path_factory.mktemp("patched")))
    out = tmp_path_factory.mktemp("fusion")
    return run_worker(fusion_worker, patched, out, "fusion"), out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_stand_in_is_what_megatron_uses_and_matches_the_unfused_gradient(fusion):
    r, _ = fusion
    assert r["fusion_available"] is True
    assert r["off_fused_apex_calls"] == 4 and r["off_unfused_apex_calls"] == 0   # 2 layers x 2 mb
    for k in ("col", "row"):
        assert _rel(r["off_fused"]["grads"][k], r["off_unfused"]["grads"][k]) < 1e-6


def test_fused_wgrad_under_mxfp8_equals_the_unfused_emulation(fusion):
    r, _ = fusion
    assert r["mxfp8_fused_apex_calls"] == 4          # accumulated by the (stand-in) fused kernel
    for k in ("col", "row"):
        fused, unfused = r["mxfp8_fused"]["grads"][k], r["mxfp8_unfused"]["grads"][k]
        off = r["off_fused"]["grads"][k]
        assert _rel(fused, unfused) < 1e-6            # same result to fp32 rounding
        assert _rel(fused, off) > 1e-3                 # and emulation really changed it
    assert torch.equal(r["mxfp8_fused"]["out"], r["mxfp8_unfused"]["out"])
    assert torch.equal(r["mxfp8_fused"]["dx"], r["mxfp8_unfused"]["dx"])


def _records(directory, **match):
    return [rec for rec in schema.read_manifest(directory)
            if all(rec.get(k) == v for k, v in match.items())]


@pytest.mark.parametrize("scen", ["capture", "capture_ddp"])
def test_captured_grad_weight_is_the_micro_batch_gradient(fusion, scen):
    r, out = fusion
    # capture changes nothing: same accumulated gradient as emulation alone
    for k in ("col", "row"):
        assert torch.equal(r[scen]["grads"][k], r["mxfp8_fused"]["grads"][k])
    assert r[f"{scen}_added_flag"] is (scen == "capture_ddp")
    for k in ("col", "row"):
        recs = _records(out / scen, module_path=k, tensor_name="grad_weight")
        assert sorted(rec["sample_idx"] for rec in recs) == [0, 1]   # one per micro-batch, no dummy
        per_mb = {}
        for rec in recs:
            t, _ = schema.load_tensor_file(out / scen / rec["file"])
            per_mb[rec["sample_idx"]] = t
            want = r[f"mxfp8_unfused_mb{rec['sample_idx']}"]["grads"][k]
            assert _rel(t, want) < 1e-6
        assert _rel(per_mb[0] + per_mb[1], r[scen]["grads"][k]) < 1e-6   # = the accumulated one
        names = {rec["tensor_name"] for rec in _records(out / scen, module_path=k)}
        assert {"grad_output_quantized_wgrad", "input_quantized_wgrad"} <= names


def test_frozen_weight_linears_are_emulated_and_captured(fusion):
    r, out = fusion
    # LinearWithFrozenWeight computes what the trainable Function computes, emulation included
    assert torch.equal(r["frozen"]["out"], r["trainable"]["out"])
    assert torch.equal(r["frozen"]["dx"], r["trainable"]["dx"])
    assert not torch.equal(r["frozen"]["out"], r["frozen_off"]["out"])
    assert r["frozen"]["grads"] == {"col": None, "row": None}
    for k in ("col", "row"):
        keys = {(rec["operation"], rec["phase"], rec["tensor_name"], rec["sample_idx"])
                for rec in _records(out / "frozen", module_path=k)}
        want = {(op, ph, n, s) for s in (0, 1) for op, ph, n in (
            ("forward", "pre", "input"), ("forward", "pre", "weight"), ("forward", "post", "output"),
            ("backward", "pre", "grad_output"), ("backward", "pre", "weight"),
            ("backward", "post", "grad_input"))}
        assert keys == want                           # no grad_weight for a frozen weight
