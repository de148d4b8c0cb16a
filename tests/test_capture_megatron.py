"""Capture and emulation on real megatron-core 0.16.1: a tiny Llama GPTModel, TP=1 and TP=2."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from capture_helpers import expected_sites, run_spawned
from error_bounds import gamma, mean_error_bound

from tensor_capture import schema
from tensor_capture.patcher import installed_megatron_core, prepare_patched_megatron


@pytest.fixture(scope="module")
def patched_dir(tmp_path_factory) -> str:
    return str(prepare_patched_megatron(tmp_path_factory.mktemp("patched")))


@pytest.fixture(scope="module")
def tp1(patched_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("tp1")
    unpatched = run_spawned(1, None, base / "unpatched", ("off",))[0]
    patched = run_spawned(1, patched_dir, base / "patched",
                          ("off", "capture", "mxfp8", "mxfp8_noattn", "te_nvfp4"))[0]
    return unpatched, patched, base / "patched"


def _records(directory: Path) -> list[dict]:
    return list(schema.read_manifest(directory))


def _same_grads(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unpatched_baseline_really_is_unpatched(tp1, patched_dir):
    unpatched, patched, _ = tp1
    assert unpatched["megatron_file"].startswith(str(installed_megatron_core()))
    assert patched["megatron_file"].startswith(patched_dir)


def test_patched_disabled_and_capture_are_bit_identical_to_unpatched(tp1):
    unpatched, patched, _ = tp1
    assert torch.equal(unpatched["loss_off"], patched["loss_off"])
    assert _same_grads(unpatched["grads_off"], patched["grads_off"])
    assert torch.equal(unpatched["loss_off"], patched["loss_capture"])
    assert _same_grads(unpatched["grads_off"], patched["grads_capture"])


def test_one_file_per_expected_tensor_with_names_that_parse(tp1):
    _, _, base = tp1
    recs = [r for r in _records(base / "capture") if r["variant"] == "hp"]
    keys = [(r["module_path"], r["operation"], r["phase"], r["tensor_name"]) for r in recs]
    assert sorted(keys) == sorted(expected_sites(2))          # each exactly once
    for r in recs:
        assert r["rank"] == 0 and r["tp_rank"] == 0 and r["iteration"] == 3
        assert r["sample_idx"] == 5 and r["quant_type"] == "fp32"
        assert r["megatron_core_version"] == "0.16.1"
        parsed = schema.parse_filename(r["file"]).to_dict()
        assert {k: r[k] for k in parsed} == parsed
        path = r["module_path"]
        want_idx = None if path == "output_layer" else int(path.split(".")[2])
        assert r["layer_idx"] == want_idx
        assert r["component"] == ("FA" if r["layer_type"] == "attention" else "linear")
        assert r["submodule"] == path.rsplit(".", 1)[-1]
    # the file content agrees with the metadata and with the tensor's own statistics
    r = next(r for r in recs if r["module_path"].endswith("layers.1.mlp.linear_fc1")
             and r["tensor_name"] == "input")
    t, meta = schema.load_tensor_file(base / "capture" / r["file"])
    assert list(t.shape) == meta["shape"] == [32, 2, 64]
    assert abs(meta["stats"]["mean"] - t.double().mean().item()) <= mean_error_bound(t) + \
        mean_error_bound(t, torch.float64)
    assert meta["stats"]["absmax"] == t.abs().max().item()
    assert sum(meta["stats"]["log2_hist"]["counts"]) == int((t != 0).sum())


def _on_mx_grid(t: torch.Tensor, axis: int) -> bool:
    """Every block of 32 along ``axis``, divided by 2^(floor(log2 amax) - 8), is an E4M3 value."""
    x = t.detach().double().movedim(axis, -1)
    pad = (-x.shape[-1]) % 32          # a partial last block behaves as if zero-padded
    x = torch.nn.functional.pad(x, (0, pad))
    b = x.reshape(-1, x.shape[-1] // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    _, e = torch.frexp(amax)
    scale = torch.pow(2.0, (e - 1 - 8).double())
    v = torch.where(amax > 0, b / scale, torch.zeros_like(b))
    return bool(torch.equal(v.float().to(torch.float8_e4m3fn).double(), v))


def test_mxfp8_operands_lie_on_the_mx_grid_and_change_the_loss(tp1):
    unpatched, patched, base = tp1
    assert not torch.equal(patched["loss_mxfp8"], unpatched["loss_off"])
    assert not torch.equal(patched["loss_mxfp8_noattn"], patched["loss_mxfp8"])
    recs = _records(base / "mxfp8")
    by = {(r["module_path"], r["operation"], r["tensor_name"]): r for r in recs}
    fc1 = "decoder.layers.0.mlp.linear_fc1"
    checks = [((fc1, "forward", "input_quantized"), -1), ((fc1, "forward", "weight_quantized"), -1),
              ((fc1, "backward", "grad_output_quantized"), -1),
              ((fc1, "backward", "weight_quantized"), 0),
              ((fc1, "backward", "grad_output_quantized_wgrad"), 0),
              ((fc1, "backward", "input_quantized_wgrad"), 0)]
    for key, axis in checks:
        r = by[key]
        assert r["quant_type"] == "mxfp8" and r["variant"] == "quantized"
        t, _ = schema.load_tensor_file(base / "mxfp8" / r["file"])
        if key[2].endswith("wgrad"):
            t = t.reshape(-1, t.shape[-1])
        assert _on_mx_grid(t, axis), key
    hp, _ = schema.load_tensor_file(base / "mxfp8" / by[(fc1, "forward", "input")]["file"])
    assert not _on_mx_grid(hp, -1)          # the check can fail: high precision is off-grid
    attn = "decoder.layers.1.self_attention.core_attention"
    q, _ = schema.load_tensor_file(base / "mxfp8" / by[(attn, "forward", "query_quantized")]["file"])
    assert _on_mx_grid(q, -1)
    qa = by[(fc1, "forward", "input")]["quant_analysis"]["mxfp8"]
    assert qa["axis"] == -1 and qa["total"] == math.prod(hp.shape) and qa["block_size"] == 32
    assert "mxfp8" not in by[(fc1, "forward", "input")]["stats"]["range"]   # scaled: no raw range
    assert (attn, "forward", "query_quantized") not in {
        (r["module_path"], r["operation"], r["tensor_name"]) for r in _records(base / "mxfp8_noattn")}


def test_te_nvfp4_recipe_trains_and_its_metadata_names_the_recipe(tp1):
    """CUSTOM_QUANT_TYPE=te_nvfp4 on the tiny Llama: each quantized linear operand is the
    recipe's quantization of the high-precision one (quant.recipes re-run on the captured
    tensor), and every record names the recipe and, for operands, the per-GEMM spec."""
    from quant import recipes

    unpatched, patched, base = tp1
    assert torch.isfinite(patched["loss_te_nvfp4"]).all()
    assert not torch.equal(patched["loss_te_nvfp4"], unpatched["loss_off"])
    recs = _records(base / "te_nvfp4")
    assert recs and all(r["recipe"] == "te_nvfp4" for r in recs)
    by = {(r["module_path"], r["operation"], r["tensor_name"]): r for r in recs}
    fc2 = "decoder.layers.0.mlp.linear_fc2"
    w = by[(fc2, "forward", "weight")]
    assert w["recipe_specs"]["fprop"] == {"kind": "nvfp4", "element": "fp4_e2m1", "tile": [16, 16],
                                          "pow2_scale": False, "rounding": "nearest_even",
                                          "rht": False}
    g = by[(fc2, "backward", "grad_output")]["recipe_specs"]
    assert g["wgrad"]["rht"] and g["wgrad"]["rounding"] == "stochastic" and not g["dgrad"]["rht"]
    for name, gemm in (("input", "fprop"), ("weight", "fprop"), ("weight", "dgrad")):
        op = "forward" if gemm == "fprop" else "backward"
        hp, _ = schema.load_tensor_file(base / "te_nvfp4" / by[(fc2, op, name)]["file"])
        qt, _ = schema.load_tensor_file(base / "te_nvfp4" / by[(fc2, op, name + "_quantized")]["file"])
        assert torch.equal(recipes.quantize_operand(hp, "te_nvfp4", name, gemm), qt), (name, gemm)
        assert not torch.equal(hp, qt)
    attn = "decoder.layers.1.self_attention.core_attention"
    assert (attn, "forward", "query_quantized") not in by     # TE's recipe leaves attention alone


def test_tp2_two_processes(patched_dir, tmp_path, tp1):
    res = run_spawned(2, patched_dir, tmp_path, ("off", "capture"))
    unpatched = tp1[0]
    for rank, r in enumerate(res):
        assert torch.equal(r["loss_off"], r["loss_capture"])
        assert _same_grads(r["grads_off"], r["grads_capture"])
        assert torch.allclose(r["loss_off"], unpatched["loss_off"], atol=1e-5)
    recs = _records(tmp_path / "capture")
    for rank in (0, 1):
        mine = [r for r in recs if r["rank"] == rank and r["variant"] == "hp"]
        keys = sorted((r["module_path"], r["operation"], r["phase"], r["tensor_name"]) for r in mine)
        assert keys == sorted(expected_sites(2))
        assert all(r["tp_rank"] == rank and r["world_size"] == 2 for r in mine)
        assert all(f"_rank{rank}_" in r["file"] for r in mine)
        assert (tmp_path / "capture" / f"manifest_rank{rank}.jsonl").is_file()
    # column-parallel weights are split along the output dim: each rank holds half of fc1
    w = [r for r in recs if r["module_path"] == "decoder.layers.0.mlp.linear_fc1"
         and r["tensor_name"] == "weight" and r["operation"] == "forward"]
    assert sorted(r["shape"][0] for r in w) == [160, 160]   # 2*160 gated rows / 2 ranks


def test_attention_probabilities_are_the_softmax_of_the_captured_query_and_key(tp1):
    """The captured P of P·V is the real map: softmax(Q·Kᵀ/sqrt(d)) under the causal mask,
    recomputed here from the captured query and key of the same call (GQA: head h reads key
    group h // (heads / groups)); its what-if numerics run along the key axis."""
    _, _, base = tp1
    by = {(r["module_path"], r["tensor_name"]): r for r in _records(base / "capture")}
    attn = "decoder.layers.1.self_attention.core_attention"
    rec = by[(attn, schema.ATTENTION_PROBS)]
    p, meta = schema.load_tensor_file(base / "capture" / rec["file"])
    q, _ = schema.load_tensor_file(base / "capture" / by[(attn, "query")]["file"])
    k, _ = schema.load_tensor_file(base / "capture" / by[(attn, "key")]["file"])
    info = meta[schema.META_PROBS_SAMPLE]
    sq, b, heads, hn = q.shape
    assert info["head_count"] == heads and info["shape"] == [b * heads, sq, sq]
    assert info["heads"] == [0, 2] and info["row_stride"] == 1     # probs_heads=2 of 4
    assert list(p.shape) == meta["shape"] == [2, sq, sq]
    per_group = heads // k.shape[2]
    causal = torch.ones(sq, sq, dtype=torch.bool).triu(1)
    for i, h in enumerate(info["heads"]):
        qh, kh = q[:, 0, h].double(), k[:, 0, h // per_group].double()
        s = qh @ kh.t() / math.sqrt(hn)
        want = torch.softmax(s.masked_fill(causal, -math.inf), dim=-1)
        # Megatron's float32 logits err by at most gamma(hn + 2) |q||k|^T / sqrt(hn) (the GEMM
        # and its scale); logits off by at most d in a row move each probability by a factor
        # within exp(+-2 d); the float32 softmax itself (max, exp, sum of sq, divide) adds
        # gamma(sq + 4) relative
        d = (gamma(hn + 2) * (qh.abs() @ kh.abs().t()) / math.sqrt(hn)).masked_fill(causal, 0)
        rel = (1 + gamma(sq + 4)) * torch.exp(2 * d.amax(-1, keepdim=True)) - 1
        gap = (p[i].double() - want).abs()
        assert bool((gap <= rel * want).all()), h
        assert bool(((p[i].double().sum(-1) - 1).abs() <= (rel * want).sum(-1)
                     + gamma(sq, torch.float64)).all()), h
    # under mxfp8 emulation the P the BMM saw is saved too, on the MX grid along the key axis
    mx = {(r["module_path"], r["tensor_name"]): r for r in _records(base / "mxfp8")}
    pq, mq = schema.load_tensor_file(base / "mxfp8" / mx[(attn, "attention_probs_quantized")]["file"])
    assert mq["variant"] == "quantized" and _on_mx_grid(pq, -1)
