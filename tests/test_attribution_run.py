"""lowp-attribute on real tiny megatron-core training (slow tier, ~1 minute in all).

- per-GEMM emulation through CUSTOM_QUANT_PLAN: a plan keeping every GEMM in bf16 trains
  exactly like bf16; keeping only the backward GEMMs leaves the first step's loss (a forward)
  that of the format, keeping only the forward GEMMs gives the first loss of bf16;
- the command end to end (JSON schema, files) on the small corpus;
- bad input: a checkpoint of another model, a plan matching no GEMM in llama-train: one line,
  exit 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from training_helpers import ROOT, one_error_line, run, small_data  # noqa: F401


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> str:
    """One patched megatron-core copy for every child process of this module."""
    from training_driver.capture import prepare_patched_tree

    return str(prepare_patched_tree(tmp_path_factory.mktemp("patched")))


_SCRIPT = r"""
import json, sys
from attribution.runner import RunSetup, RunTask, _Worker
from quant.precision_plan import dump_plan, plan_from_dict
data, tok, work = sys.argv[1:4]
plans = {"all_bf16": {"rules": [{"format": "bf16"}]},
         "back_bf16": {"rules": [{"roles": ["dgrad", "wgrad"], "format": "bf16"}]},
         "fwd_bf16": {"rules": [{"roles": ["fprop"], "format": "bf16"}]}}
paths = {}
for name, raw in plans.items():
    paths[name] = f"{work}/{name}.yaml"
    open(paths[name], "w").write(dump_plan(plan_from_dict(raw)))
w = _Worker(RunSetup(data, tok, steps=4, patched_dir=sys.argv[4]))
out = {"bf16": w.run(RunTask("bf16", 1, "bf16")).losses,
       "fp8": w.run(RunTask("fp8", 1, "fp8_e4m3")).losses}
for name, path in paths.items():
    out[name] = w.run(RunTask(name, 1, "fp8_e4m3", path)).losses
print(json.dumps(out))
"""


def test_plans_set_each_gemm_role_through_custom_quant_plan(small_data, tmp_path,
                                                           patched):
    proc = run([sys.executable, "-c", _SCRIPT, small_data["data_path"], small_data["tokenizer"],
                str(tmp_path), patched], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = json.loads(proc.stdout.strip().splitlines()[-1])
    assert losses["all_bf16"] == losses["bf16"]                 # every GEMM of the plan: bf16
    assert losses["fp8"] != losses["bf16"]
    assert losses["back_bf16"][0] == losses["fp8"][0]           # step 1's loss: forward only
    assert losses["fwd_bf16"][0] == losses["bf16"][0]
    assert losses["back_bf16"][1:] != losses["fp8"][1:]         # backward GEMMs in bf16 differ
    assert losses["fwd_bf16"][1:] != losses["bf16"][1:]


def test_the_command_writes_the_report_json_plan_and_figure(small_data, tmp_path,
                                                            patched):
    out = tmp_path / "out"
    proc = run([sys.executable, "-m", "attribution.cli", "--format", "fp8_e4m3",
                "--data-path", small_data["data_path"], "--tokenizer", small_data["tokenizer"],
                "--steps", "30", "--seeds", "2", "--workers", "2", "--bisect-rounds", "1",
                "--out", str(out), "--json", str(tmp_path / "r.json")], cwd=tmp_path,
               timeout=400, MEGATRON_LOWP_PATCHED_DIR=patched)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "estimate:" in proc.stderr and "gap" in proc.stdout
    res = json.loads((tmp_path / "r.json").read_text())
    assert {"format", "reference", "steps", "seeds", "gap", "significant", "ablations",
            "plan"} <= set(res)
    assert res["format"] == "fp8_e4m3" and res["reference"] == "bf16" and res["seeds"] == [1, 2]
    assert set(res["gap"]) >= {"mean", "std"}
    if res["significant"]:      # unscaled fp8 gradients flush: expected after 30 steps
        row = res["ablations"][0]
        assert set(row) >= {"high_precision", "gap_closed", "gap_closed_std"}
        assert set(row["high_precision"]) >= {"roles", "layers"}
        assert Path(res["plan"]["file"]).is_file() and (out / "attribution.png").is_file()
        from quant.precision_plan import load_plan

        load_plan(res["plan"]["file"])      # what CUSTOM_QUANT_PLAN reads
    else:
        assert res["ablations"] == [] and "no significant gap" in proc.stdout


def test_a_checkpoint_of_another_model_is_one_line(tmp_path):
    from attribution.runner import load_checkpoint_state
    from lowp_common import UserError
    from training_driver.checkpoint import _shard_name

    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000005").mkdir(parents=True)
    torch.save({"config": {"hidden_size": 32, "num_layers": 2}, "model": {}, "optimizer": {}},
               ckpt / "iter_0000005" / _shard_name(0, 0))
    from training_driver.checkpoint import LATEST_FILE

    (ckpt / LATEST_FILE).write_text("5\n")
    with pytest.raises(UserError, match="another model .*hidden_size=32"):
        load_checkpoint_state(str(ckpt), {"hidden_size": 64, "num_layers": 2}, 512)
    with pytest.raises(UserError, match="no checkpoint there"):
        load_checkpoint_state(str(tmp_path), {"hidden_size": 64}, 512)


def test_bad_format_and_a_plan_matching_no_gemm_exit_2_with_one_line(small_data, tmp_path,
                                                                     patched):
    proc = run([sys.executable, "-m", "attribution.cli", "--format", "fp9"], cwd=tmp_path)
    assert proc.returncode == 2 and "format='fp9' is not a known format" in one_error_line(proc.stderr)
    plan = tmp_path / "plan.yaml"
    plan.write_text("rules:\n  - modules: linear_fc9\n    format: bf16\n")
    proc = run([sys.executable, "-m", "training_driver.train", "--data-path",
                small_data["data_path"], "--tokenizer", small_data["tokenizer"],
                "--train-iters", "1"],
               cwd=tmp_path, CUSTOM_QUANT_TYPE="fp8_e4m3", CUSTOM_QUANT_PLAN=str(plan),
               MEGATRON_LOWP_PATCHED_DIR=patched)
    assert proc.returncode == 2
    assert "matches no GEMM of this model" in one_error_line(proc.stderr)
