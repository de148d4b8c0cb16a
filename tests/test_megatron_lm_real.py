"""Megatron-LM's own ``pretrain_gpt.py`` (tag core_v0.16.1), run through our launcher on the CPU.

The seeds' workflow launches ``train_llama32_1b_h100_fp8.sh`` with ``MEGATRON_LM_DIR``; these
tests do exactly that with the real Megatron-LM training loop, unpacked from
``../shared/megatron-lm/`` (skipped with one line where that tarball is absent, as on a user's
machine: Megatron-LM's training loop is on no package registry). The launcher, the patch set,
capture and emulation run unchanged; Megatron-LM's own CUDA calls are answered on the CPU by
``megatron_lm_support/`` (each stand-in naming the Megatron-LM line that needs it), loaded only
in these tests' processes.

One module-scoped checkout serves every case: 1 process (mxfp8, then a resume with stats of every
iteration, what-if numbers and a precision plan, then the diagnosis and the report), TP=2 (nvfp4,
the flight recorder and a NaN planted in a real run), DP=2 through ``python -m te_integration.megatron_lm``, PP=2.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from training_helpers import ROOT, run, small_data  # noqa: F401

from quant.gemm_plan import format_quantizer, linear_forward
from tensor_capture.schema import META_WHATIF, load_tensor_file, read_manifest
from training_driver.megatron_env import free_port

TARBALL = ROOT.parent / "shared" / "megatron-lm" / "Megatron-LM-core_v0.16.1.tar.gz"
SUPPORT = Path(__file__).resolve().parent / "megatron_lm_support"
EXAMPLE = ["bash", str(ROOT / "examples" / "llama" / "train_llama32_1b_h100_fp8.sh")]
START_LINE = "tensor capture: "
LOSS = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([-+0-9.Ee]+|nan|inf)", re.I)

pytestmark = [pytest.mark.megatron, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """Megatron-LM core_v0.16.1, unpacked, its dataset helpers built once (make + pybind11)."""
    if not TARBALL.is_file():
        pytest.skip(f"{TARBALL} is absent: the real pretrain_gpt.py cannot be run here")
    root = tmp_path_factory.mktemp("megatron_lm")
    with tarfile.open(TARBALL) as tar:
        tar.extractall(root, filter="data")
    tree = next(root.iterdir())
    built = subprocess.run(["make", "-C", str(tree / "megatron/core/datasets")],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    return tree


def launch(checkout: Path, data: dict, work: Path, *, nproc: int = 1, iters: int = 2,
           extra_args: str = "", timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """The launcher on ``checkout`` with MODEL=tiny; CHECKPOINT_PATH work/ckpt."""
    work.mkdir(parents=True, exist_ok=True)
    settings = dict(
        PYTHONPATH=os.pathsep.join([str(SUPPORT), str(ROOT)]), LOWP_MEGATRON_LM_CPU_STANDINS="1",
        QUANT_COMPILE="0", MEGATRON_LM_DIR=str(checkout), MODEL="tiny", TRAIN_ITERS=str(iters),
        MICRO_BATCH_SIZE="2", GLOBAL_BATCH_SIZE="4", GPUS_PER_NODE=str(nproc),
        MASTER_PORT=str(free_port()), SAVE_INTERVAL="1000",
        MEGATRON_LM_EXTRA_ARGS=f"--eval-iters 0 {extra_args}".strip())
    settings.update(env)
    return run([*EXAMPLE, str(work / "ckpt"), str(work / "tb"), data["tokenizer"],
                data["data_path"], "bf16"], cwd=work, timeout=timeout, **settings)


def losses(out: subprocess.CompletedProcess) -> dict[int, float]:
    """Megatron-LM's logged lm loss per (1-based) iteration."""
    return {int(m.group(1)): float(m.group(3)) for m in LOSS.finditer(out.stdout + out.stderr)}


def ok(out: subprocess.CompletedProcess) -> str:
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    return text


def records(capture: Path) -> list[dict]:
    return list(read_manifest(capture))


def _stats_config(path: Path, save_dir: Path) -> str:
    path.write_text(f"enabled: true\nsave_dir: {save_dir}\nstats_only: true\nmax_iterations: unlimited\n"
                    "whatif_formats: default\n")
    return str(path)


def _saved(capture: Path, module: str, name: str) -> torch.Tensor:
    for f in sorted(capture.glob("*.pt")):
        tensor, meta = load_tensor_file(f)
        if (meta.get("module_path"), meta.get("tensor_name"), meta.get("sample_idx"),
                meta.get("operation")) == (module, name, 0, "forward"):
            return tensor
    raise AssertionError(f"no {name} of {module} in {capture}")


def test_every_flag_the_launcher_adds_is_one_this_megatron_lm_declares(checkout):
    """The machine flags and the local layers' flags are options of Megatron-LM's own parser
    (``add_megatron_arguments``; a misspelt flag would stop pretrain_gpt.py at parse time)."""
    from training_driver.megatron_lm.command import MACHINE_FLAGS, transformer_impl_args

    flags = [f for rule in MACHINE_FLAGS for f in rule.flags] + transformer_impl_args("bf16")
    probe = ("import argparse, json, sys\n"
             "from megatron.training.arguments import add_megatron_arguments\n"
             "p = add_megatron_arguments(argparse.ArgumentParser())\n"
             "print(json.dumps(sorted(p._option_string_actions)))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=checkout, capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(checkout)})
    assert out.returncode == 0, out.stderr[-3000:]
    declared = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert {f for f in flags if f.startswith("--")} <= declared


def test_one_process_mxfp8_then_a_resume_with_stats_a_plan_the_diagnosis_and_the_report(
        checkout, small_data, tmp_path):
    work = tmp_path / "run"
    # 1. mxfp8 emulated, tensors of iteration 0 saved; Megatron stops (and saves a torch_dist
    #    checkpoint, whose writer process re-imports pretrain_gpt.py) at iteration 2 of 4
    first = launch(checkout, small_data, work, iters=4, extra_args="--exit-interval 2",
                   TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(work / "tensors"),
                   CUSTOM_QUANT_TYPE="mxfp8")
    text = ok(first)
    assert "MODEL=tiny" in text and "--transformer-impl local" in text
    got = losses(first)
    assert sorted(got) == [1, 2] and all(0 < v < 10 for v in got.values()), got
    starts = [line for line in text.splitlines() if line.startswith(START_LINE + "tensors and")]
    assert len(starts) == 1, starts          # not again from the checkpoint writer process
    assert "saving checkpoint at iteration       2" in text
    files = sorted((work / "tensors").glob("*.pt"))
    assert files and all("_iter0_" in f.name and "_mxfp8_rank0_" in f.name for f in files)
    # the emulated fprop of linear_qkv: exactly Q_mxfp8(input) @ Q_mxfp8(weight).T
    qkv = "decoder.layers.0.self_attention.linear_qkv"
    x, w, y = (_saved(work / "tensors", qkv, n) for n in ("input", "weight", "output"))
    assert x.dtype == torch.bfloat16
    assert torch.equal(y, linear_forward(x, w, None, format_quantizer("mxfp8")))
    assert not torch.equal(y, linear_forward(x, w, None))

    # 2. resume: numbering continues from Megatron's own iteration; statistics of every
    #    iteration with what-if numbers; a precision plan keeps layer 1's fc2 in high precision
    plan = work / "plan.yaml"
    plan.write_text("default: mxfp8\nrules:\n  - modules: 'mlp\\.linear_fc2$'\n    layers: [1]\n"
                    "    format: hp\n")
    stats = work / "stats"
    second = launch(checkout, small_data, work, iters=4, extra_args="--no-load-rng",
                    TENSOR_SAVE_CONFIG=_stats_config(work / "capture.yaml", stats),
                    CUSTOM_QUANT_TYPE="mxfp8", CUSTOM_QUANT_PLAN=str(plan))
    text = ok(second)
    assert "loading distributed checkpoint from" in text and "at iteration 2" in text
    got = losses(second)
    assert sorted(got) == [3, 4] and all(0 < v < 10 for v in got.values()), got
    recs = records(stats)
    assert {r["iteration"] for r in recs} == {2, 3}
    assert not list(stats.glob("*.pt"))                    # statistics only
    def computed(module: str) -> set[tuple]:   # what each GEMM of its operands computed in
        return {(spec["kind"], spec.get("element")) for r in recs if r.get("module_path") == module
                for spec in (r.get("recipe_specs") or {}).values()}

    assert computed("decoder.layers.1.mlp.linear_fc2") == {("hp", None)}
    assert computed("decoder.layers.0.mlp.linear_fc2") == {("format", "mxfp8")}
    assert any(META_WHATIF in r for r in recs)

    # 3. the diagnosis and the one-click report read what the real run captured
    diag = run([sys.executable, "-m", "tensor_viz.diagnose.cli", str(stats), "--json",
                str(work / "diagnosis.json")], cwd=work, timeout=300)
    assert diag.returncode == 0, diag.stderr[-3000:]
    data = json.loads((work / "diagnosis.json").read_text())
    assert data["records"] == len(recs)
    report = run(["bash", str(ROOT / "script" / "one_click_visualize.sh"), str(stats),
                  str(work / "draw")], cwd=work, timeout=600)
    assert report.returncode == 0, report.stderr[-3000:]
    assert (work / "draw" / "index.html").is_file()


def test_tensor_parallel_nvfp4_flight_recorder_and_a_nan_planted_in_a_real_run(
        checkout, small_data, tmp_path):
    """TP=2 over gloo with nvfp4 emulated and capture in recorder mode; a NaN put into layer 1's
    fc1 input on rank 0 in iteration 1: both ranks agree on a trigger there, the ring (iterations
    0..1) and the triggered capture (iteration 2) are records of both TP ranks, the replay file
    names Megatron-LM's own command, and lowp-diagnose says where the first non-finite value was
    born, at the micro-batch."""
    from tensor_capture.recorder import read as recorder_read
    from tensor_viz.diagnose import diagnose

    work = tmp_path / "tp2"
    caps = work / "recorder"
    config = tmp_path / "recorder.yaml"
    config.write_text(f"mode: recorder\nsave_dir: {caps}\nstats_only: true\n"
                      "recorder_window: 4\nrecorder_trigger_iterations: 1\n")
    out = launch(checkout, small_data, work, nproc=2, iters=3,
                 extra_args="--no-check-for-nan-in-loss-and-grad --ckpt-format torch",
                 TP="2", TENSOR_SAVE_CONFIG=str(config), CUSTOM_QUANT_TYPE="nvfp4",
                 LOWP_TEST_PLANT_NAN="0:decoder.layers.1.mlp.linear_fc1:1:1")
    text = ok(out)
    got = losses(out)
    assert 0 < got[1] < 10, got
    # iteration 1 (0-based; Megatron logs it as 2) is the NaN's: no finite loss, a NaN norm
    assert 2 not in got or got[2] != got[2], got
    assert re.search(r"iteration\s+2/\s*3 \|[^\n]*grad norm: nan", text), text[-3000:]
    triggers = recorder_read.read_triggers(caps)
    assert {(t["iteration"], t["rank"]) for t in triggers} == {(1, 0), (1, 1)}, triggers
    assert all("nonfinite" in t["kinds"] for t in triggers)
    recs = records(caps)
    assert {r["tp_rank"] for r in recs} == {0, 1} and {r["iteration"] for r in recs} == {0, 1, 2}
    assert {r["emulated_format"] for r in recs if r.get("emulated_format")} == {"nvfp4"}
    assert recorder_read.summary_files(caps)
    replay = recorder_read.read_replays(caps)[0]
    assert replay["iteration"] == 1 and "pretrain_gpt" in replay["commands"], replay
    first = diagnose(caps).findings[0].to_dict()
    assert (first["kind"], first["severity"]) == ("first_nonfinite", "HIGH")
    assert (first["iteration"], first["sample_idx"], first["rank"]) == (1, 1, 0)
    assert (first["module_path"], first["operation"], first["tensor_name"]) == (
        "decoder.layers.1.mlp.linear_fc1", "forward", "input")


def test_the_auto_guard_rescales_unscaled_fp8_in_a_tensor_parallel_real_run(
        checkout, small_data, tmp_path):
    """pretrain_gpt.py, TP=2 over gloo, unscaled fp8_e4m3 with TENSOR_SAVE_GUARD=on: the
    gradients flush from the first iterations, both ranks judge the same all-reduced numbers and
    write the same decisions (a scaled variant, no high precision), and the plan they hand back
    reads as a CUSTOM_QUANT_PLAN."""
    from quant.precision_plan import load_plan
    from tensor_capture.guard import DECISIONS, GUARD_DIR, PLAN_FILE, SUMMARY_FILE

    work = tmp_path / "guard"
    out = launch(checkout, small_data, work, nproc=2, iters=4, TP="2",
                 TENSOR_SAVE_GUARD="on", TENSOR_SAVE_DIR=str(work / "capture"),
                 CUSTOM_QUANT_TYPE="fp8_e4m3")
    text = ok(out)
    got = losses(out)
    assert sorted(got) == [1, 2, 3, 4] and all(0 < v < 10 for v in got.values()), got
    folder = work / "capture" / GUARD_DIR
    ranks = [(folder / f"decisions_rank{r}.jsonl").read_text().splitlines() for r in (0, 1)]
    assert ranks[0] and ranks[0] == ranks[1]
    assert (folder / DECISIONS).read_text().splitlines() == ranks[0]
    decided = [json.loads(line) for line in ranks[0]]
    assert {d["to"] for d in decided} == {"fp8_e4m3_tensor"}
    assert "tensor capture: guard: iteration" in text
    summary = json.loads((folder / SUMMARY_FILE).read_text())
    assert summary["hp_flops_share"] == 0.0 and summary["decisions"] == len(decided)
    plan = load_plan(folder / PLAN_FILE)
    d = decided[0]
    assert plan.format_for(d["module"], None, d["gemm"]) == "fp8_e4m3_tensor"


def test_data_parallel_through_the_te_integration_entry(checkout, small_data, tmp_path):
    """DRY_RUN=1 prints the exact command and creates nothing; the same command, with the
    entry point te_integration.megatron_lm in front of pretrain_gpt.py, trains DP=2."""
    work = tmp_path / "dp2"
    stats = work / "stats"
    env = dict(TENSOR_SAVE_CONFIG=_stats_config(tmp_path / "capture.yaml", stats),
               CUSTOM_QUANT_TYPE="mxfp8")
    dry = launch(checkout, small_data, work, nproc=2, extra_args="--ckpt-format torch",
                 DRY_RUN="1", **env)
    assert dry.returncode == 0, dry.stderr
    assert list(work.iterdir()) == []                      # nothing copied, patched or made
    command = dry.stdout.strip().splitlines()[-1].split(" ")
    script = next(i for i, a in enumerate(command) if a.endswith("pretrain_gpt.py"))
    tree = Path(command[script]).parent
    shutil.copytree(checkout, tree)
    patched = subprocess.run(["bash", str(ROOT / "patches" / "apply_patches.sh"), str(tree)],
                             capture_output=True, text=True)
    assert patched.returncode == 0, patched.stderr
    command[script:script] = ["-m", "te_integration.megatron_lm"]
    port = command.index("--master-port") + 1
    command[port] = str(free_port())
    out = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), str(ROOT)]),
                              "LOWP_MEGATRON_LM_CPU_STANDINS": "1", "QUANT_COMPILE": "0",
                              "CUDA_DEVICE_MAX_CONNECTIONS": "1", **env})
    ok(out)
    got = losses(out)
    assert sorted(got) == [1, 2] and all(0 < v < 10 for v in got.values()), got
    recs = records(stats)
    assert {r["dp_rank"] for r in recs} == {0, 1} and {r["rank"] for r in recs} == {0, 1}


def test_pipeline_parallel(checkout, small_data, tmp_path):
    """PP=2 over gloo: Megatron-LM's 1F1B schedule sends activations between the two stages;
    each stage captures its own layer under Megatron's numbering."""
    work = tmp_path / "pp2"
    stats = work / "stats"
    out = launch(checkout, small_data, work, nproc=2, extra_args="--ckpt-format torch",
                 PP="2", IGNORE_RESOURCE_CHECK="1",
                 TENSOR_SAVE_CONFIG=_stats_config(tmp_path / "capture.yaml", stats),
                 CUSTOM_QUANT_TYPE="mxfp8")
    ok(out)
    got = losses(out)
    assert sorted(got) == [1, 2] and all(0 < v < 10 for v in got.values()), got
    recs = records(stats)
    layers = {(r["pp_rank"], r["layer_idx"]) for r in recs if r.get("layer_idx") is not None}
    assert {0, 1} == {pp for pp, _ in layers}
    assert {layer for pp, layer in layers if pp == 1} and all(
        layer >= 1 for pp, layer in layers if pp == 1 and layer is not None)
