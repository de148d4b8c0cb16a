"""lowp-diagnose on real training (slow tier): the tiny Llama trained by ``llama-train`` on the
small corpus with AdamW, a stats-only capture of every iteration; nothing planted.

- unscaled ``fp8_e4m3`` at the default learning rate: the gradients are far below e4m3's
  smallest subnormal (2^-9), so the run's own format flushes them; findings[0] names that flush
  (GEMM, operand, iteration) and the remedy;
- the same at lr 0.5 without clipping: the loss diverges (above 1.5 x its early values); the
  flush stays first and ``--loss`` adds the divergence, tied to it;
- bf16 at lr 0.05 (no QK-norm in the tiny Llama): the attention logits grow (the bound on
  max |q.k|/sqrt(d) from ~1.5 past 30 in 5 iterations), named as attention_logit_growth;
- bf16 at the default learning rate (the control): none of these findings.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from training_helpers import run, small_data  # noqa: F401

from tensor_viz.diagnose import cli as diagnose_cli
from tensor_viz.diagnose import diagnose

#: scenario -> (CUSTOM_QUANT_TYPE, iterations, extra llama-train options)
RUNS = {"fp8": ("fp8_e4m3", 3, []),
        "fp8_lr": ("fp8_e4m3", 5, ["--lr", "0.5", "--clip-grad", "0"]),
        "bf16": ("bf16", 5, []),
        "bf16_lr": ("bf16", 5, ["--lr", "0.05"])}


@pytest.fixture(scope="module")
def trained(small_data, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    from training_driver.capture import prepare_patched_tree

    root = tmp_path_factory.mktemp("diagnose_training")
    patched = str(prepare_patched_tree(root / "patched"))
    cfg = root / "capture.yaml"
    cfg.write_text("stats_only: true\nmax_iterations: unlimited\n")
    out = {}
    for name, (fmt, iters, extra) in RUNS.items():
        cap, log = root / name, root / f"{name}.log"
        proc = run([sys.executable, "-m", "training_driver.train", "--data-path",
                    small_data["data_path"], "--tokenizer", small_data["tokenizer"],
                    "--model", "tiny", "--train-iters", str(iters), "--log-interval", "1",
                    *extra], cwd=root, timeout=240, TENSOR_SAVE_ENABLED="true",
                   TENSOR_SAVE_DIR=str(cap), TENSOR_SAVE_CONFIG=str(cfg), CUSTOM_QUANT_TYPE=fmt,
                   MEGATRON_LOWP_PATCHED_DIR=patched)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log.write_text(proc.stdout + proc.stderr)
        out[name] = (cap, log)
    return out


def _losses(log: Path) -> list[float]:
    return [float(ln.split("| loss ")[1].split()[0]) for ln in log.read_text().splitlines()
            if ln.startswith("iter ") and "| loss " in ln]


def test_unscaled_fp8_names_the_backward_flush_of_its_own_format_first(trained):
    cap, log = trained["fp8"]
    # the capture saw it too: its pre-quantization warning on a gradient at iteration 1
    assert "grad_output" in log.read_text() and "flushed to zero" in log.read_text()
    first = diagnose(cap).findings[0].to_dict()
    assert (first["kind"], first["severity"]) == ("run_format_loss", "HIGH"), first["summary"]
    assert (first["operation"], first["tensor_name"], first["iteration"]) == (
        "backward", "grad_output", 0)
    ev = first["evidence"]
    assert (ev["format"], ev["problem"], ev["gemms"], ev["operand"]) == (
        "fp8_e4m3", "flush", ["dgrad", "wgrad"], "grad_output")
    assert ev["flush_to_zero_ratio"] > 0.5 and ev["operands_at_level"] > 1
    assert ev["energy_flushed"] > 0.5                  # the update itself is lost, not a tail
    assert "from iteration 0" in first["summary"] and "dgrad/wgrad" in first["summary"]
    for remedy in ("loss scale", "fp8_e4m3_tensor", "fp8_e5m2", "CUSTOM_QUANT_PLAN"):
        assert remedy in first["action"]
    findings = diagnose(cap).findings
    # no forward operand loses a percent of its energy: the forward is not blamed
    assert not [f for f in findings if f.kind == "run_format_loss"
                and f.where["operation"] == "forward" and f.severity == "HIGH"]
    # the output layer's gradient: nearly every element flushed (the non-target softmax terms)
    # but the target terms, most of its energy, survive: MEDIUM, after the cause
    out = [f for f in findings if f.kind == "run_format_loss"
           and f.where["module_path"] == "output_layer"]
    assert len(out) == 1 and out[0].severity == "MEDIUM"
    assert out[0].evidence["flushed_within_binades"] > 0.9 > 0.01 > out[0].evidence["energy_flushed"]


def test_a_diverging_fp8_run_gives_the_flush_first_and_the_divergence(trained, capsys):
    cap, log = trained["fp8_lr"]
    losses = _losses(log)
    assert max(losses[1:]) > 1.5 * losses[0]                     # it diverged, really
    assert diagnose_cli.main([str(cap), "--loss", str(log), "--json", "-"]) == 0
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert (findings[0]["kind"], findings[0]["operation"], findings[0]["tensor_name"]) == (
        "run_format_loss", "backward", "grad_output")
    div = [f for f in findings if f["kind"] == "loss_divergence"]
    assert len(div) == 1 and div[0]["severity"] == "HIGH"
    first_high = next(i + 1 for i in range(1, len(losses))      # llama-train counts from 1
                      if losses[i] > 1.5 * min(losses[:min(i, 5)]))
    assert div[0]["iteration"] == first_high                     # the log's first iteration above
    assert div[0]["evidence"]["follows"]["kind"] == "run_format_loss"
    assert findings.index(div[0]) > 0


def test_a_high_learning_rate_without_qk_norm_grows_the_attention_logits(trained):
    cap, _ = trained["bf16_lr"]
    findings = diagnose(cap).findings
    first = findings[0]
    assert (first.kind, first.severity) == ("attention_logit_growth", "HIGH"), first.summary
    growth = [f for f in findings if f.kind == "attention_logit_growth"]
    assert all(f.evidence["bound_last"] > 30 > 4 * f.evidence["bound_first"] for f in growth)
    assert "qk-layernorm" in first.action


def test_bf16_at_the_default_learning_rate_has_none_of_them(trained):
    cap, log = trained["bf16"]
    kinds = {f.kind for f in diagnose(cap, loss=log).findings}
    assert not kinds & {"run_format_loss", "loss_divergence", "attention_logit_growth"}, kinds
