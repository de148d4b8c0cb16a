"""Layer-wise precision diff on a plain nn.Module and on a real megatron-core GPTModel."""
from __future__ import annotations

import json
import math

import pytest
import torch

from training_profiler.layer_diff import find_jump, layer_diff, main
from training_profiler.lowp_emulation import emulate_linears


def _mlp(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    x = torch.randn(16, 32)
    y = torch.randint(0, 4, (16,))
    return model, (lambda m: torch.nn.functional.cross_entropy(m(x), y) * 1000)


def test_grouped_passes_equal_one_pass() -> None:
    model, step = _mlp()
    a = layer_diff(model, step, "mxfp8", group_size=1)
    b = layer_diff(model, step, "mxfp8", group_size=None)
    assert a.groups == 4 and b.groups == 1 and a.passes == 9
    assert [l.name for l in a.layers] == ["0", "2", "4", "6"]
    for la, lb in zip(a.layers, b.layers):
        assert (la.fwd_rel_error, la.grad_rel_error, la.fwd_cosine) == (lb.fwd_rel_error, lb.grad_rel_error, lb.fwd_cosine)
    assert all(0 < l.fwd_rel_error < 0.2 and l.fwd_cosine > 0.98 for l in a.layers)


def test_fp32_mode_has_zero_error_and_model_is_left_untouched() -> None:
    model, step = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = {n: p for n, p in model.named_parameters()}
    rep = layer_diff(model, step, "fp32")
    assert all(l.fwd_rel_error == 0 and l.grad_rel_error == 0 for l in rep.layers)
    rep = layer_diff(model, step, "fp8_e4m3")
    for n, p in model.named_parameters():
        assert p is params[n] and p.grad is None and torch.equal(p, before[n])


def test_injected_bad_layer_is_named_first_jump() -> None:
    model, step = _mlp()
    with torch.no_grad():
        model[4].weight.mul_(1e4)   # beyond fp8_e4m3's 448: this layer's weights saturate
    rep = layer_diff(model, step, "fp8_e4m3", group_size=2)
    assert rep.first_jump == "4", rep.to_text()
    assert rep.layers[2].fwd_rel_error > 4 * rep.layers[1].fwd_rel_error
    assert "<-- first jump" in rep.to_text()


def test_autocast_mode_on_cpu() -> None:
    model, step = _mlp()
    rep = layer_diff(model, step, "autocast_bf16")
    assert all(1e-4 < l.fwd_rel_error < 5e-2 for l in rep.layers)
    assert not rep.notes


def test_emulation_quantizes_forward_operands_exactly() -> None:
    import quant

    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 8)
    x = torch.randn(4, 32)
    with emulate_linears(lin, "mxfp4") as names:
        y = lin(x)
    expected = torch.nn.functional.linear(quant.quantize(x, "mxfp4"), quant.quantize(lin.weight, "mxfp4"), lin.bias)
    assert names == [""] and torch.equal(y, expected)
    assert isinstance(lin.weight, torch.nn.Parameter)


def test_find_jump_rules() -> None:
    assert find_jump([0.01, 0.012, 0.011], 4, 1e-3) == (None, 0.0)
    idx, ratio = find_jump([0.01, 0.012, 0.1, 0.5], 4, 1e-3)
    assert idx == 2 and math.isclose(ratio, 0.1 / 0.012)
    assert find_jump([0.0, 0.0, math.nan], 4, 1e-3)[0] == 2


def test_bad_mode_and_layers() -> None:
    model, step = _mlp()
    with pytest.raises(ValueError, match="--mode='fp7' is not a known format"):
        layer_diff(model, step, "fp7")
    with pytest.raises(ValueError, match="layers not in the model"):
        layer_diff(model, step, "bf16", layers=["nope"])


def test_cli_mlp_json(capsys) -> None:
    assert main(["--model", "mlp", "--mode", "fp8_e5m2", "--format", "json", "--group-size", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "fp8_e5m2" and len(data["layers"]) == 5 and data["groups"] == 3
    assert main(["--model", "mlp", "--mode", "fp7"]) == 2
    assert "precision-diff: error: --mode='fp7' is not a known format" in capsys.readouterr().err


def _cli(*args: str):
    """precision-diff as a user runs it: a fresh interpreter, no warning filters of ours."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "training_profiler.layer_diff", *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("args,message", [
    (["--mode", "mxfp9"], "--mode='mxfp9' is not a known format; valid: "),
    (["--mode", "mxfp8", "--num-layers", "0"], "--num-layers >= 1"),
])
def test_cli_mistake_is_one_line_before_megatron(args, message) -> None:
    """A bad --mode printed 14 lines of megatron-core warnings first. Now the
    arguments are checked before megatron is imported: one line, exit 2."""
    out = _cli(*args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith("precision-diff: error: ") and message in out.stderr


def test_megatron_cli_prints_no_import_warnings() -> None:
    """The tiny GPT run: megatron-core's TE/apex notes are silenced (stderr holds the progress
    bar only), the report is on stdout."""
    out = _cli("--mode", "mxfp8", "--num-layers", "1")
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr and "warnings.warn" not in out.stderr, out.stderr
    assert "Layer-wise precision diff: fp32 vs mxfp8" in out.stdout


@pytest.fixture(scope="module")
def tiny_gpt():
    from training_driver.megatron_env import (
        LlamaShape,
        build_llama_model,
        causal_inputs,
        destroy_distributed,
        free_port,
        init_distributed,
    )

    init_distributed(0, 1, master_port=free_port())
    try:
        shape = LlamaShape(num_layers=1, hidden_size=32, ffn_hidden_size=64, seq_length=16)
        model = build_llama_model(shape)
        tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_length), generator=torch.Generator().manual_seed(0))
        yield model, (lambda m: m(tokens, labels=tokens, **causal_inputs(tokens)).mean())
    finally:
        destroy_distributed()


def test_megatron_gpt_grouped_diff(tiny_gpt) -> None:
    model, step = tiny_gpt
    a = layer_diff(model, step, "mxfp8", group_size=3)
    b = layer_diff(model, step, "mxfp8", group_size=None)
    names = [l.name for l in a.layers]
    assert names[0] == "embedding.word_embeddings" and names[-1] == "output_layer"
    assert "decoder.layers.0.self_attention.linear_qkv" in names and a.groups == math.ceil(len(names) / 3)
    assert [l.fwd_rel_error for l in a.layers] == [l.fwd_rel_error for l in b.layers]
    lin = {l.name: l for l in a.layers if l.module_type in ("ColumnParallelLinear", "RowParallelLinear")}
    assert len(lin) == 5 and all(0 < l.fwd_rel_error < 0.2 and 0.98 < l.grad_cosine for l in lin.values())
    assert a.first_jump == "decoder.layers.0.self_attention.linear_qkv"  # first quantized GEMM


def test_megatron_gpt_injected_jump(tiny_gpt) -> None:
    model, step = tiny_gpt
    w = model.decoder.layers[0].mlp.linear_fc1.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(1e5)
        rep = layer_diff(model, step, "fp8_e4m3", group_size=4)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    errs = {l.name: l.fwd_rel_error for l in rep.layers}
    # The attention GEMMs carry fp8's ordinary error; fc1 (saturating weights) jumps.
    assert errs["decoder.layers.0.mlp.linear_fc1"] > 4 * errs["decoder.layers.0.pre_mlp_layernorm"]
    jump_order = [l.name for l in rep.layers]
    assert jump_order.index(rep.first_jump) <= jump_order.index("decoder.layers.0.mlp.linear_fc1")


def test_watch_training_on_megatron_gpt(tiny_gpt) -> None:
    """The monitor's hooks work on megatron-core layers (tuple outputs, TP linears)."""
    from training_profiler import watch_training

    model, step_loss = tiny_gpt
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    @watch_training(warmup_steps=8, alert_window=8, model=model, sinks=[], layer_stats_every=1,
                    sync_every=5)
    def train_step(poison: bool = False):
        opt.zero_grad()
        loss = step_loss(model)
        if poison:
            loss = loss * float("nan")
        loss.backward()
        if not poison:
            opt.step()
        return loss

    try:
        for i in range(20):
            train_step(poison=(i == 15))
        train_step.monitor.close()
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
                p.grad = None
    mon = train_step.monitor
    assert "decoder.layers.0.self_attention.linear_qkv" in mon.layers
    assert all(math.isfinite(h["act_overflow_ratio_max"]) for h in mon.history[:15])
    found = {(a["step"], a["metric"]) for a in mon.alerts}
    assert (16, "loss_nonfinite") in found and (16, "grad_norm_nonfinite") in found
    assert not any(a["step"] < 16 for a in mon.alerts), [a["message"] for a in mon.alerts]
