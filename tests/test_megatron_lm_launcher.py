"""The launcher's Megatron-LM command (issue 38, fixes 1-6): flags chosen from what imports,
MODEL and the shape variables honoured, what would crash or hang later refused in one line
before torchrun, one capture start line per job, DRY_RUN without side effects, and
``apply_patches.sh --help`` without an install. The real pretrain_gpt.py runs in
test_megatron_lm_real.py; here the launcher runs on a stand-in checkout (test_training_scripts)
or its pieces are called directly."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest
from test_training_scripts import _example_args, _standin_checkout
from training_helpers import ROOT, one_error_line, run, small_data  # noqa: F401

from lowp_common.cli import UserError
from training_driver.megatron_env import free_port
from training_driver.megatron_lm.command import (
    REQUIREMENTS,
    Machine,
    check_requirements,
    machine_flags,
    model_shape,
    shape_args,
    transformer_impl_args,
)
from training_driver.train_config import MODEL_SHAPES

EXAMPLE = ["bash", str(ROOT / "examples" / "llama" / "train_llama32_1b_h100_fp8.sh")]
BARE = Machine(cuda=False, te=False, apex_softmax=False, apex_wgrad=False, te_custom_recipe=False)
FULL = Machine(cuda=True, te=True, apex_softmax=True, apex_wgrad=True, te_custom_recipe=False)


def test_local_layers_turn_off_persist_layer_norm():
    """Fix 1: the local RMSNorm (WrappedTorchNorm) asserts on persist_layer_norm, which
    Megatron-LM's arguments turn on by default; TE layers keep it."""
    assert "--no-persist-layer-norm" in transformer_impl_args("bf16")
    assert "--no-persist-layer-norm" not in transformer_impl_args("fp8")
    assert transformer_impl_args("fp8")[:2] == ["--transformer-impl", "transformer_engine"]


@pytest.mark.parametrize("flag, missing", [
    ("--no-rope-fusion", "te"),                     # fix 2: TransformerConfig refuses it
    ("--no-masked-softmax-fusion", "apex_softmax"),  # fix 3: fused_softmax imports apex's kernel
    ("--no-gradient-accumulation-fusion", "apex_wgrad"),
    ("--use-cpu-initialization", "cuda"),
])
def test_a_fusion_is_turned_off_exactly_when_what_it_needs_does_not_import(flag, missing):
    from dataclasses import replace

    flags, notes = machine_flags(replace(FULL, **{missing: False}))
    assert flag in flags and any(flag in n for n in notes)
    assert flag not in machine_flags(FULL)[0]
    assert flag in machine_flags(BARE)[0]


def test_model_and_shape_variables_make_the_shape():
    """Fix 4: MODEL=tiny is the tiny shape, not the 1B; a shape variable replaces one field."""
    tiny = model_shape("tiny", {})
    assert tiny == MODEL_SHAPES["tiny"]
    args = shape_args(model_shape("llama32_1b", {"num_layers": 4}))
    pairs = dict(zip(args, args[1:]))
    assert pairs["--num-layers"] == "4" and pairs["--hidden-size"] == "2048"
    assert pairs["--seq-length"] == pairs["--max-position-embeddings"] == "2048"
    with pytest.raises(UserError, match="MODEL='tny' is unknown: choose one of llama32_1b, tiny"):
        model_shape("tny", {})
    with pytest.raises(UserError, match="NUM_ATTENTION_HEADS=4 is not a multiple of NUM_QUERY_GROUPS=3"):
        model_shape("tiny", {"num_query_groups": 3})


@pytest.mark.parametrize("missing", [r.module for r in REQUIREMENTS])
def test_a_missing_requirement_is_one_line_naming_the_install(tmp_path, missing):
    """Fix 5: six (pretrain_gpt.py's import chain), psutil (else the checkpoint writer dies and
    training waits forever), pybind11 (dataset helpers), transformers."""
    with pytest.raises(UserError) as err:
        check_requirements(tmp_path, present=lambda m: m != missing)
    text = str(err.value)
    assert f"pip install {missing}" in text and 'pip install -e ".[megatron-lm]"' in text
    assert "\n" not in text


def test_pybind11_is_not_needed_once_the_dataset_helpers_are_built(tmp_path):
    helpers = tmp_path / "megatron/core/datasets"
    helpers.mkdir(parents=True)
    (helpers / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}").write_bytes(b"")
    check_requirements(tmp_path, present=lambda m: m != "pybind11")


def _launch(small_data, tmp_path, **env):
    return run([*EXAMPLE, *_example_args(tmp_path, small_data)], cwd=tmp_path, timeout=240,
               GPUS_PER_NODE="1", MASTER_PORT=str(free_port()),
               PROBE_OUT=str(tmp_path / "probe.json"), **env)


def test_dry_run_prints_the_tiny_megatron_lm_command_and_changes_nothing(small_data, tmp_path):
    """Fixes 1-4 and 6 on the launcher itself: MODEL=tiny and NUM_LAYERS reach pretrain_gpt.py,
    the flags this machine needs are there, and DRY_RUN=1 copies, patches and creates nothing."""
    checkout = _standin_checkout(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    out = _launch(small_data, tmp_path, MEGATRON_LM_DIR=str(checkout), MODEL="tiny",
                  NUM_LAYERS="3", TENSOR_SAVE_ENABLED="true", DRY_RUN="1",
                  MEGATRON_LM_EXTRA_ARGS="--exit-interval 5")
    assert out.returncode == 0, out.stderr
    argv = out.stdout.strip().splitlines()[-1].split(" ")
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--num-layers"] == "3" and pairs["--hidden-size"] == "64"
    assert pairs["--seq-length"] == "64" and pairs["--exit-interval"] == "5"
    flags, _ = machine_flags(Machine.here())
    for flag in ["--no-persist-layer-norm", *flags]:
        assert flag in argv
    assert sorted(p.name for p in tmp_path.iterdir()) == before    # nothing made


@pytest.mark.parametrize("env, message", [
    ({"MODEL": "tny"}, "MODEL='tny' is unknown"),
    ({"MODEL": "tiny", "NUM_LAYERS": "0"}, "NUM_LAYERS=0 must be a positive integer"),
    ({"MODEL": "tiny", "TRAIN_ITERS": "3", "WARMUP_ITERS": "5"},
     "WARMUP_ITERS=5 must be an integer below TRAIN_ITERS=3"),
    ({"MODEL": "tiny", "CUSTOM_QUANT_TYPE": "mxfp8", "CUSTOM_QUANT_PLAN": "PLAN"},
     "matches no"),
])
def test_mistakes_are_one_line_before_torchrun(small_data, tmp_path, env, message):
    checkout = _standin_checkout(tmp_path)
    if env.get("CUSTOM_QUANT_PLAN") == "PLAN":
        plan = tmp_path / "plan.yaml"
        plan.write_text("rules:\n  - layers: [7]\n    format: hp\n")   # tiny has layers 0-1
        env = {**env, "CUSTOM_QUANT_PLAN": str(plan)}
    out = _launch(small_data, tmp_path, MEGATRON_LM_DIR=str(checkout), **env)
    line = one_error_line(out.stderr)
    assert out.returncode == 2 and line.startswith("train_llama32_1b_h100_fp8.sh: error: "), out.stderr
    assert message in line
    assert not (tmp_path / "probe.json").exists() and not (tmp_path / "ckpt").exists()


def test_the_driver_path_refuses_an_unknown_model_too(small_data, tmp_path):
    out = _launch(small_data, tmp_path, MODEL="tny", IGNORE_RESOURCE_CHECK="1")
    assert out.returncode == 2 and "MODEL='tny' is unknown" in one_error_line(out.stderr)
    assert not (tmp_path / "ckpt").exists()


def test_a_missing_package_of_megatron_lm_is_refused_before_torchrun(small_data, tmp_path):
    """psutil that does not import (a stand-in package raising ImportError): one line naming
    the install, exit 2, nothing started or made (it used to hang at the first checkpoint)."""
    checkout = _standin_checkout(tmp_path)
    shim = tmp_path / "no_psutil"
    (shim / "psutil").mkdir(parents=True)
    (shim / "psutil" / "__init__.py").write_text("raise ImportError('stand-in: absent')\n")
    out = _launch(small_data, tmp_path, MEGATRON_LM_DIR=str(checkout), MODEL="tiny",
                  PYTHONPATH=os.pathsep.join([str(ROOT), str(shim)]))
    line = one_error_line(out.stderr)
    assert out.returncode == 2 and "pip install psutil" in line, out.stderr
    assert not (tmp_path / "probe.json").exists() and not (tmp_path / "ckpt").exists()


CHILD = """
import multiprocessing as mp, sys
sys.path.insert(0, sys.argv[1])
def child():
    import tensor_saver  # noqa: F401  (the in-tree module, as a spawned writer re-imports it)
if __name__ == "__main__":
    import tensor_saver  # noqa: F401
    p = mp.get_context("spawn").Process(target=child)
    p.start(); p.join()
    sys.exit(p.exitcode)
"""


def test_a_child_process_does_not_print_the_capture_start_line_again(tmp_path):
    """Fix 6: Megatron's torch_dist checkpoint writer (a spawned process) re-imports
    pretrain_gpt.py and so the in-tree module; the start line is printed once per job."""
    script = tmp_path / "parent.py"
    script.write_text(CHILD)
    out = run([sys.executable, str(script), str(ROOT / "megatron" / "core")], cwd=tmp_path,
              timeout=120, TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(tmp_path / "t"))
    assert out.returncode == 0, out.stderr
    starts = [line for line in out.stderr.splitlines() if line.startswith("tensor capture: ")]
    assert len(starts) == 1, out.stderr


def test_apply_patches_help_works_without_the_package_installed(tmp_path):
    """Fix 6: `patches/apply_patches.sh --help` from any folder with the project not
    installed (a python that skips site-packages stands for a fresh machine)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    (fake / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    out = subprocess.run(["bash", str(ROOT / "patches" / "apply_patches.sh"), "--help"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: megatron-tensor-patch" in out.stdout
