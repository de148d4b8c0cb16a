"""The launch scripts end to end: the embedded default collection run and the Llama example."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from training_helpers import ROOT, clean_env, one_error_line, run, small_data  # noqa: F401

from quant.formats import WHATIF_FORMATS
from tensor_capture.schema import (
    META_VARIANT,
    META_WHATIF,
    VARIANT_QUANTIZED,
    load_tensor_file,
    parse_filename,
    read_manifest,
)
from training_driver.collector import full_iteration_saved, summarize
from training_driver.megatron_env import free_port

COLLECT = ["bash", str(ROOT / "run_wikipedia_tensor_collection.sh")]
EXAMPLE = ["bash", str(ROOT / "examples" / "llama" / "train_llama32_1b_h100_fp8.sh")]


def _check_tensor_dir(tensor_dir: Path) -> list[Path]:
    files = sorted(tensor_dir.rglob("*.pt"))
    for f in files:                             # every saved file is whole and loadable
        tensor, meta = load_tensor_file(f)
        assert isinstance(tensor, torch.Tensor) and tensor.numel() > 0
        assert parse_filename(f.name).layer_type in ("attention", "linear")
    return files


def test_embedded_default_run_collects_tensors(tmp_path):
    """No data, no GPU: corpus from Python's docs, HF byte-level BPE, tiny Llama, capture, summary."""
    out = run([*COLLECT, "--train-iters", "3", "--default-corpus-chars", "80000", "--no-visualize"],
              cwd=tmp_path, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "embedded default" in text and "tensor summary for" in text
    tensor_dir = tmp_path / "enhanced_tensor_logs"
    files = _check_tensor_dir(tensor_dir)
    assert len(files) >= 10
    s = summarize(tensor_dir)
    assert s.files == len(files)
    assert set(s.by_layer_type) == {"attention", "linear"}
    assert set(s.by_operation) == {"forward", "backward"}
    assert set(s.by_quant_type) == {"hifp8"}
    assert set(s.iterations) == {0}             # exactly one captured iteration (max_iterations: 1)
    # the quantized operands (the report's measured error) and the what-if numerics are captured
    assert any(parse_filename(f.name).tensor_name.endswith("_quantized") for f in files)
    hp = [r for r in read_manifest(tensor_dir) if r.get(META_VARIANT) != VARIANT_QUANTIZED]
    assert hp and all(list(r[META_WHATIF]["formats"]) == list(WHATIF_FORMATS) for r in hp)
    assert f"{s.files} files" in text
    manifest = list(read_manifest(tensor_dir))
    assert {r["file"] for r in manifest if r.get("file")} >= {f.name for f in files if f.parent == tensor_dir}
    # the corpus was built here from local text, and the tokenizer trained on it
    assert (tmp_path / "runs/default/data/tokenizer/tokenizer.json").is_file()
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(tmp_path / "runs/default/data/tokenizer")) == 512
    assert (tmp_path / "runs/default/data/python_docs_text_document.idx").is_file()


def test_embedded_capture_config_saves_operands_and_whatif(tmp_path):
    from tensor_capture.config import load_config
    from training_driver.collector import embedded_capture_yaml

    path = tmp_path / "capture.yaml"
    path.write_text(embedded_capture_yaml())
    cfg = load_config(env={"TENSOR_SAVE_CONFIG": str(path)})
    assert (cfg.max_iterations, cfg.save_quantized, cfg.whatif_formats) == (1, True, WHATIF_FORMATS)


def test_full_iteration_rule():
    names = [Path(f"20250101_000000_{i:04d}_iter0_linear_L0_forward_pre_linear_hifp8_rank0_sample0_input.pt")
             for i in range(12)]
    assert not full_iteration_saved(names[:9], {"iteration": 3}, 10)     # too few files
    assert not full_iteration_saved(names, {"iteration": 0}, 10)         # iteration 0 not finished
    assert full_iteration_saved(names, {"iteration": 1}, 10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _group_commands(pgid: int) -> list[str]:
    """The command lines of process group ``pgid``'s processes (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                out.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return out


def _start_collector(small_data, tmp_path: Path, sigint: str) -> subprocess.Popen:
    """The collector as its own process group (a terminal's foreground job); ``sigint="ignored"``
    starts it the way a background job of a script (or a test runner started so) is: SIGINT
    ignored on entry, inherited by every child."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint == "ignored" else None
    return subprocess.Popen(
        [*COLLECT, "--data-path", small_data["data_path"], "--tokenizer", small_data["tokenizer"],
         "--train-iters", "400", "--keep-training", "--workdir", str(tmp_path / "w"),
         "--tensor-dir", str(tmp_path / "t"), "--ready-file", str(tmp_path / "ready"),
         "--", "--seq-length", "32"],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=ignore)


def _ctrl_c(proc: subprocess.Popen, to: str = "group") -> tuple[str, str, float]:
    """Ctrl-C to the whole foreground group (or SIGINT to the collector alone, ``kill -INT``);
    (stdout, stderr, seconds until the collector exits)."""
    t0 = time.monotonic()
    (os.killpg if to == "group" else os.kill)(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    return stdout, stderr, time.monotonic() - t0


@pytest.mark.parametrize("sigint,to", [("default", "group"), ("ignored", "group"),
                                       ("ignored", "collector")])
def test_ctrl_c_leaves_saved_tensors_intact(small_data, tmp_path, sigint, to):
    """Ctrl-C once training runs (the collector's ready file, not a file count): collector and
    training stop within seconds, exit 130, the saved files are whole. "ignored" was a real
    failure: launched with SIGINT ignored, both ran all 400 iterations and exited 0.
    "collector": SIGINT to the collector only; it stops training itself."""
    proc = _start_collector(small_data, tmp_path, sigint)
    deadline = time.monotonic() + 240
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the collector never reported training under way"
        time.sleep(0.1)
    stdout, stderr, seconds = _ctrl_c(proc, to)
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert seconds < 30, seconds
    assert not _group_alive(proc.pid)           # training stopped too, nothing left running
    assert "iter   400/400" not in stdout
    assert "intact" in stderr and "Traceback" not in stderr
    files = _check_tensor_dir(tmp_path / "t")
    assert files
    assert not list((tmp_path / "t").rglob("*.tmp*"))


def test_ctrl_c_while_training_starts(small_data, tmp_path):
    """Ctrl-C the moment the training process exists (interpreter start, imports, model build),
    with SIGINT inherited as ignored: still 130 within seconds and no process left."""
    proc = _start_collector(small_data, tmp_path, "ignored")
    deadline = time.monotonic() + 120
    while not any("training_driver.train" in c for c in _group_commands(proc.pid)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.02)
    stdout, stderr, seconds = _ctrl_c(proc)
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert seconds < 30, seconds
    assert not _group_alive(proc.pid), (_group_commands(proc.pid), stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert re.search(r"interrupted; the \d+ tensor files saved so far are intact", stderr), stderr
    assert not list((tmp_path / "t").rglob("*.tmp*"))


@pytest.mark.parametrize("rank_code,code,extra", [
    (2, 2, None),            # a user mistake inside a rank: its one line, nothing after it
    (3, 3, "torchrun: error: rank 0: a training process exited with status 3 (see its message "
            "above)"),
    (0, 0, None),
])
def test_torchrun_wrapper_never_adds_a_traceback(tmp_path, rank_code, code, extra):
    """Torchrun printed ~30 lines of ChildFailedError traceback after a rank's own
    one-line message and exited 1. The launchers' training_driver.torchrun keeps the rank's
    status (2 stays 2) and adds at most one line."""
    script = tmp_path / "rank.py"
    script.write_text("import sys\nprint('rank: error: the message', file=sys.stderr)\n"
                      f"sys.exit({rank_code})\n")
    out = run([sys.executable, "-m", "training_driver.torchrun", "--nproc-per-node", "1",
               "--master-port", str(free_port()), str(script)], cwd=tmp_path, timeout=120)
    assert out.returncode == code, out.stderr
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert lines == ["rank: error: the message"] + ([extra] if extra else []), out.stderr


def test_torchrun_wrapper_from_the_launcher_keeps_a_ranks_user_error(small_data, tmp_path):
    """A mistake only a rank can see (a checkpoint of another shape, found at resume): the
    launcher ends with the rank's one line and exit 2, no torchrun traceback."""
    common = dict(MODEL="tiny", TRAIN_ITERS="1", GLOBAL_BATCH_SIZE="2")
    first = run([*EXAMPLE, *_example_args(tmp_path, small_data)], cwd=tmp_path, timeout=300,
                SEQ_LENGTH="32", MASTER_PORT=str(free_port()), **common)
    assert first.returncode == 0, first.stderr[-3000:]
    out = run([*EXAMPLE, *_example_args(tmp_path, small_data)], cwd=tmp_path, timeout=300,
              SEQ_LENGTH="48", MASTER_PORT=str(free_port()), **common)
    assert out.returncode == 2, out.stderr[-3000:]
    line = one_error_line(out.stderr)
    assert line.startswith("llama-train: error: ") and "seq_length" in line, out.stderr
    assert "ChildFailedError" not in out.stderr


@pytest.mark.parametrize("args,message", [
    (["--data-path", "nowhere/x_text_document", "--tokenizer", "nowhere"], "has no"),
    (["--data-path", "nowhere/x_text_document"], "needs --tokenizer"),
    (["--nproc", "0"], "at least 1"),
    (["--quant-type", "bogus"], "CUSTOM_QUANT_TYPE='bogus' is not a known format"),
])
def test_collector_bad_input(tmp_path, args, message):
    out = run([*COLLECT, *args], cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert message in one_error_line(out.stderr)


def test_collector_port_in_use(small_data, tmp_path):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run([*COLLECT, "--data-path", small_data["data_path"], "--tokenizer",
                   small_data["tokenizer"]], cwd=tmp_path, timeout=120, MASTER_PORT=str(port))
    assert out.returncode == 2
    assert f"MASTER_PORT={port} is in use" in one_error_line(out.stderr)


def _example_args(tmp_path: Path, data: dict, dtype: str = "bf16") -> list[str]:
    return [str(tmp_path / "ckpt"), str(tmp_path / "tb"), data["tokenizer"], data["data_path"], dtype]


@pytest.mark.parametrize("mutate,env,message", [
    (lambda a: a[:3], {}, "expected 5 arguments"),
    (lambda a: a[:4] + ["fp16"], {}, "DTYPE must be bf16 or fp8"),
    (lambda a: a[:2] + ["no/such/tokenizer"] + a[3:], {}, "TOKENIZER_PATH no/such/tokenizer does not exist: give a Hugging Face tokenizer folder; "
     "Llama-3.2's: huggingface-cli download meta-llama/Llama-3.2-1B"),
    (lambda a: a[:3] + ["no/such/data"] + a[4:], {}, "has no .bin/.idx: make it from your text with "
     "preprocess-corpus --input CORPUS.jsonl --tokenizer"),
    (lambda a: a[:4] + ["fp8"], {}, "fp8 needs"),
    (lambda a: a, {"MEGATRON_LM_DIR": "/no/such/Megatron-LM"}, "MEGATRON_LM_DIR=/no/such/Megatron-LM is not a directory"),
])
def test_example_script_bad_input(small_data, tmp_path, mutate, env, message):
    if "fp8" in message and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = run([*EXAMPLE, *mutate(_example_args(tmp_path, small_data))], cwd=tmp_path, timeout=120, **env)
    assert out.returncode == 2
    assert message in one_error_line(out.stderr)


def test_example_script_rejects_a_checkout_without_pretrain_gpt(small_data, tmp_path):
    (tmp_path / "Megatron-LM").mkdir()
    out = run([*EXAMPLE, *_example_args(tmp_path, small_data)], cwd=tmp_path, timeout=120,
              MEGATRON_LM_DIR=str(tmp_path / "Megatron-LM"))
    assert out.returncode == 2 and "has no pretrain_gpt.py" in one_error_line(out.stderr)


def test_example_script_trains_and_captures(small_data, tmp_path):
    """The seed's command line (bf16) on the project's driver, with capture on; tiny model on CPU."""
    out = run([*EXAMPLE, *_example_args(tmp_path, small_data)], cwd=tmp_path, timeout=300,
              MODEL="tiny", TRAIN_ITERS="2", SEQ_LENGTH="32", GLOBAL_BATCH_SIZE="2",
              MASTER_PORT=str(free_port()), TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(tmp_path / "tensors"),
              CUSTOM_QUANT_TYPE="mxfp8")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "iter     2/2" in out.stdout and "tensor capture ON" in out.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    files = _check_tensor_dir(tmp_path / "tensors")
    assert files and {parse_filename(f.name).quant_type for f in files} == {"mxfp8"}
    state = torch.load(tmp_path / "ckpt" / "iter_0000002" / "model_tp00_pp00.pt", weights_only=True)
    assert state["config"]["dtype"] == "bf16"
    assert all(v.dtype == torch.bfloat16 for k, v in state["model"].items()
               if isinstance(v, torch.Tensor) and v.is_floating_point())
    assert len(state["master_params"]) > 0 and state["master_params"][0].dtype == torch.float32


def test_example_script_emulates_a_megatron_recipe_without_the_hardware(small_data, tmp_path):
    """FP8_RECIPE=blockwise with DTYPE bf16 (any machine): the run emulates TE's recipe through
    CUSTOM_QUANT_TYPE=te_fp8_blockwise, and the captured metadata names the recipe."""
    out = run([*EXAMPLE, *_example_args(tmp_path, small_data)], cwd=tmp_path, timeout=300,
              MODEL="tiny", TRAIN_ITERS="1", SEQ_LENGTH="32", GLOBAL_BATCH_SIZE="2",
              MASTER_PORT=str(free_port()), TENSOR_SAVE_ENABLED="true",
              TENSOR_SAVE_DIR=str(tmp_path / "tensors"), FP8_RECIPE="blockwise")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "FP8_RECIPE=blockwise is emulated with CUSTOM_QUANT_TYPE=te_fp8_blockwise" in out.stderr
    files = _check_tensor_dir(tmp_path / "tensors")
    assert files and {parse_filename(f.name).quant_type for f in files} == {"te_fp8_blockwise"}
    from tensor_capture.schema import read_manifest

    recs = list(read_manifest(tmp_path / "tensors"))
    assert recs and {r["recipe"] for r in recs} == {"te_fp8_blockwise"}
    w = next(r for r in recs if r["tensor_name"] == "weight" and r["operation"] == "forward")
    assert w["recipe_specs"]["fprop"]["tile"] == [128, 128]


def _standin_checkout(tmp_path: Path, version: tuple[int, int, int] | None = None,
                      factory_flag: bool = True) -> Path:
    """A stand-in Megatron-LM checkout (real Megatron-LM is not installed here).

    It holds the megatron-core files the patch set reads, copied from the installed
    megatron-core (``version`` rewrites package_info.py), a pretrain_gpt.py that records its
    arguments and whether the megatron next to it (first on sys.path) is patched, and the line
    of megatron/training/arguments.py the launcher looks for (``--fp8-quantizer-factory``, as
    Megatron-LM main declares it; ``factory_flag=False``: an arguments.py without it).
    """
    import shutil

    import megatron.core
    from tensor_capture.patcher import TREE_FILES

    installed = Path(megatron.core.__file__).parent.parent.parent
    checkout = tmp_path / "Megatron-LM"
    for rel in TREE_FILES:                      # just the files the patch set reads
        if (installed / rel).is_file():
            (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(installed / rel, checkout / rel)
    if version is not None:
        (checkout / "megatron/core/package_info.py").write_text(
            "MAJOR = {}\nMINOR = {}\nPATCH = {}\nPRE_RELEASE = ''\n".format(*version))
    (checkout / "megatron/training").mkdir(parents=True, exist_ok=True)
    (checkout / "megatron/training/arguments.py").write_text(
        "def _add_transformer_engine_args(parser):\n    group = parser.add_argument_group('te')\n"
        + ("    group.add_argument('--fp8-quantizer-factory', type=str, default=None)\n"
           if factory_flag else "")
        + "    return parser\n")
    (checkout / "pretrain_gpt.py").write_text(
        "import json, os, sys\n"
        "layers = os.path.join(sys.path[0], 'megatron/core/tensor_parallel/layers.py')\n"
        "out = {'argv': sys.argv[1:], 'layers': layers,\n"
        "       'patched': '_tensor_saver' in open(layers).read()}\n"
        "open(os.environ['PROBE_OUT'], 'w').write(json.dumps(out))\n")
    return checkout


def _apex_importable() -> bool:
    out = subprocess.run([sys.executable, "-c", "import torch, fused_weight_gradient_mlp_cuda"],
                         capture_output=True)
    return out.returncode == 0


@pytest.mark.parametrize("apex", [False, True], ids=["no-apex", "apex-standin"])
def test_example_script_runs_a_megatron_lm_checkout_on_a_patched_copy(small_data, tmp_path, apex):
    """MEGATRON_LM_DIR: version checked, the checkout copied and patched, and its pretrain_gpt.py
    gets the 1B args; gradient-accumulation fusion is turned off exactly when apex's
    fused_weight_gradient_mlp_cuda does not import ("apex-standin": an empty module of that
    name on PYTHONPATH, a narrow stand-in for the launcher's import check only). The
    apex-standin case names the tokenizer by its tokenizer.json file: Megatron-LM gets the
    directory, which is what AutoTokenizer.from_pretrained takes."""
    if not apex and _apex_importable():
        pytest.skip("apex is installed here: the no-apex case cannot be run")
    checkout = _standin_checkout(tmp_path)
    extra = {}
    if apex:
        shim = tmp_path / "apex_standin"
        shim.mkdir()
        (shim / "fused_weight_gradient_mlp_cuda.py").write_text("# stand-in: import check only\n")
        extra["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(shim)])
    args = _example_args(tmp_path, small_data)
    if apex:
        args[2] = str(Path(small_data["tokenizer"]) / "tokenizer.json")
    out = run([*EXAMPLE, *args], cwd=tmp_path, timeout=240,
              MEGATRON_LM_DIR=str(checkout), TENSOR_SAVE_ENABLED="true", GPUS_PER_NODE="1",
              MASTER_PORT=str(free_port()), PROBE_OUT=str(tmp_path / "probe.json"),
              TRAIN_ITERS="7", IGNORE_RESOURCE_CHECK="1", **extra)   # the 1B args, no training
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    import megatron.core.package_info as info

    assert f"megatron-core {info.__version__}" in out.stderr      # the version was detected
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["patched"] and str(tmp_path / "ckpt" / ".lowp") in probe["layers"]
    argv = probe["argv"]
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--num-layers"] == "16" and pairs["--hidden-size"] == "2048"
    assert pairs["--num-query-groups"] == "8" and pairs["--rotary-base"] == "500000"
    assert pairs["--data-path"] == small_data["data_path"] and pairs["--train-iters"] == "7"
    assert pairs["--tokenizer-type"] == "HuggingFaceTokenizer"
    assert pairs["--tokenizer-model"] == small_data["tokenizer"]
    assert pairs["--transformer-impl"] == "local"
    assert "--bf16" in argv and "--swiglu" in argv and "--fp8-format" not in argv
    assert ("--no-gradient-accumulation-fusion" in argv) == (not apex)
    assert ("passing --no-gradient-accumulation-fusion" in out.stderr) == (not apex)
    # the user's checkout itself is untouched
    assert "_tensor_saver" not in (checkout / "megatron/core/tensor_parallel/layers.py").read_text()


def test_example_script_megatron_lm_needs_transformers(small_data, tmp_path):
    """Megatron-LM's HuggingFaceTokenizer calls transformers.AutoTokenizer: without transformers
    (a stand-in package that fails to import) one line and exit 2, before anything runs."""
    checkout = _standin_checkout(tmp_path)
    shim = tmp_path / "no_transformers"
    (shim / "transformers").mkdir(parents=True)
    (shim / "transformers" / "__init__.py").write_text("raise ImportError('stand-in: absent')\n")
    out = run([*EXAMPLE, *_example_args(tmp_path, small_data)], cwd=tmp_path, timeout=120,
              MEGATRON_LM_DIR=str(checkout), PROBE_OUT=str(tmp_path / "probe.json"),
              PYTHONPATH=os.pathsep.join([str(ROOT), str(shim)]))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "pip install transformers" in one_error_line(out.stderr)
    assert not (tmp_path / "probe.json").exists() and not (tmp_path / "ckpt").exists()


def test_example_script_refuses_an_unsupported_megatron_version(small_data, tmp_path):
    checkout = _standin_checkout(tmp_path, version=(0, 12, 0))
    out = run([*EXAMPLE, *_example_args(tmp_path, small_data)], cwd=tmp_path, timeout=120,
              MEGATRON_LM_DIR=str(checkout), PROBE_OUT=str(tmp_path / "probe.json"))
    line = one_error_line(out.stderr)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert line.startswith("train_llama32_1b_h100_fp8.sh: error: MEGATRON_LM_DIR=")
    assert "megatron-core 0.12.0 is not supported; supported:" in line
    assert not (tmp_path / "probe.json").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("env,dtype,message", [
    ({"CUSTOM_QUANT_TYPE": "mxfp9"}, "bf16", "CUSTOM_QUANT_TYPE='mxfp9' is not a known format"),
    ({"CUSTOM_QUANT_TYPE": "mxfp9", "MEGATRON_LM_DIR": "CHECKOUT"}, "fp8",
     "CUSTOM_QUANT_TYPE='mxfp9' is not a known format"),
    ({"FP8_RECIPE": "mxfp9"}, "bf16", "FP8_RECIPE=mxfp9 is unknown: choose one of delayed"),
    ({"FP4_RECIPE": "nvfp4"}, "fp8", "FP4_RECIPE=nvfp4 with DTYPE fp8 needs"),
    ({"FP8_RECIPE": "mxfp8", "CUSTOM_QUANT_TYPE": "hifp8"}, "bf16", "disagree: set one of them"),
    ({"FP4_RECIPE": "nvfp4"}, "bf16", "CUSTOM_QUANT_TYPE=te_nvfp4 needs a multiple of 16"),
], ids=["typo", "typo-te-megatron-lm", "recipe-typo", "recipe-no-hardware",
        "recipe-and-quant-type", "recipe-cannot-tile-the-tiny-ffn"])
def test_example_script_quant_mistakes_are_one_line(small_data, tmp_path, env, dtype, message):
    """Before torchrun starts: no traceback, one line, exit 2 (on any machine, GPU or not)."""
    if env.get("MEGATRON_LM_DIR") == "CHECKOUT":
        env = {**env, "MEGATRON_LM_DIR": str(_standin_checkout(tmp_path))}
    if "FP4_RECIPE" in env and dtype == "bf16":     # the tiny model's ffn (172) is checked
        env = {**env, "MODEL": "tiny", "SEQ_LENGTH": "32", "GLOBAL_BATCH_SIZE": "2"}
    out = run([*EXAMPLE, *_example_args(tmp_path, small_data, dtype)], cwd=tmp_path, timeout=120,
              PROBE_OUT=str(tmp_path / "probe.json"), **env)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert message in one_error_line(out.stderr)
    assert not (tmp_path / "probe.json").exists()


def _dry_run_argv(out: subprocess.CompletedProcess) -> list[str]:
    import shlex

    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return shlex.split(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("quant", ["mxfp8", "nvfp4", ""])
def test_example_script_te_linears_with_custom_quant_type_get_the_custom_recipe(
        small_data, tmp_path, quant):
    """DTYPE fp8 selects Transformer Engine linears; with CUSTOM_QUANT_TYPE set the
    launcher passes Megatron-LM's custom recipe with our quantizer factory (read here from
    the command DRY_RUN=1 prints; no GPU needed to see it), without it TE's hybrid FP8."""
    checkout = _standin_checkout(tmp_path)
    env = dict(MEGATRON_LM_DIR=str(checkout), GPUS_PER_NODE="1", MASTER_PORT=str(free_port()),
               PROBE_OUT=str(tmp_path / "probe.json"), IGNORE_RESOURCE_CHECK="1", DRY_RUN="1")
    if quant:
        env["CUSTOM_QUANT_TYPE"] = quant
    out = run([*EXAMPLE, *_example_args(tmp_path, small_data, "fp8")], cwd=tmp_path,
              timeout=240, **env)
    argv = _dry_run_argv(out)
    pairs = dict(zip(argv, argv[1:]))
    assert argv[argv.index("-m") + 1] == "training_driver.torchrun"
    assert any(a.endswith("megatron-lm/pretrain_gpt.py") for a in argv)
    assert pairs["--transformer-impl"] == "transformer_engine" and pairs["--fp8-format"] == "hybrid"
    if quant:
        assert pairs["--fp8-recipe"] == "custom"
        assert pairs["--fp8-quantizer-factory"] == "te_integration.factory.quantizer_factory"
        assert "--fp8-amax-history-len" not in argv
        # never the custom recipe with fused wgrad accumulation (TE's custom GEMM drops the
        # add into main_grad), and pretrain_gpt.py runs through the entry point naming TE layers
        assert "--no-gradient-accumulation-fusion" in argv
        script = next(i for i, a in enumerate(argv) if a.endswith("megatron-lm/pretrain_gpt.py"))
        assert argv[script - 2:script] == ["-m", "te_integration.megatron_lm"]
        assert f"CUSTOM_QUANT_TYPE={quant} on Transformer Engine linears" in out.stderr
        # the path resolves to the factory megatron-core will call
        from te_integration import factory

        assert factory.FACTORY_PATH == pairs["--fp8-quantizer-factory"]
    else:
        assert "--fp8-recipe" not in argv and pairs["--fp8-amax-history-len"] == "1024"
    assert not (tmp_path / "probe.json").exists()      # nothing ran


def _dry_run_fp8(small_data, tmp_path, checkout, **env):
    env = dict(MEGATRON_LM_DIR=str(checkout), GPUS_PER_NODE="1", MASTER_PORT=str(free_port()),
               PROBE_OUT=str(tmp_path / "probe.json"), IGNORE_RESOURCE_CHECK="1", DRY_RUN="1",
               **env)
    return run([*EXAMPLE, *_example_args(tmp_path, small_data, "fp8")], cwd=tmp_path,
               timeout=240, **env)


def test_example_script_never_combines_the_custom_recipe_with_fused_wgrad_even_with_apex(
        small_data, tmp_path):
    """Problem 1 at the launcher: with apex importable (a stand-in module of that name on
    PYTHONPATH, for the launcher's import check only) the custom recipe still gets
    --no-gradient-accumulation-fusion; without CUSTOM_QUANT_TYPE, apex keeps fusion on."""
    shim = tmp_path / "apex_standin"
    shim.mkdir()
    (shim / "fused_weight_gradient_mlp_cuda.py").write_text("# stand-in: import check only\n")
    path = os.pathsep.join([str(ROOT), str(shim)])
    checkout = _standin_checkout(tmp_path)
    custom = _dry_run_argv(_dry_run_fp8(small_data, tmp_path, checkout, CUSTOM_QUANT_TYPE="mxfp8",
                                        PYTHONPATH=path))
    native = _dry_run_argv(_dry_run_fp8(small_data, tmp_path, checkout, PYTHONPATH=path))
    assert "--fp8-quantizer-factory" in custom and "--no-gradient-accumulation-fusion" in custom
    assert "--fp8-quantizer-factory" not in native
    assert "--no-gradient-accumulation-fusion" not in native


def test_example_script_refuses_a_megatron_lm_without_the_factory_flag(small_data, tmp_path):
    checkout = _standin_checkout(tmp_path, factory_flag=False)
    out = _dry_run_fp8(small_data, tmp_path, checkout, CUSTOM_QUANT_TYPE="mxfp8")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    line = one_error_line(out.stderr)
    assert "this Megatron-LM has no --fp8-quantizer-factory" in line


def test_example_script_runs_te_debug_features_without_tensor_inspect_flags(small_data, tmp_path):
    """Released Megatron-LM has no --tensor-inspect flags (pull request #3811 only): the
    launcher checks TE_INSPECT_CONFIG and runs pretrain_gpt.py through our entry point."""
    pytest.importorskip("nvdlfw_inspect", reason="nvdlfw-inspect (the te extra) is not installed")
    checkout = _standin_checkout(tmp_path)
    cfg = ROOT / "examples" / "te" / "inspect_megatron_lm.yaml"
    argv = _dry_run_argv(_dry_run_fp8(small_data, tmp_path, checkout, TE_INSPECT_CONFIG=str(cfg)))
    assert not any(a.startswith("--tensor-inspect") for a in argv)
    i = argv.index("te_integration.megatron_lm")
    assert argv[i + 1:i + 3] == ["--inspect-config", str(cfg)]
    assert argv[i + 5].endswith("megatron-lm/pretrain_gpt.py")
    bad = tmp_path / "bad.yaml"
    bad.write_text(cfg.read_text().replace("LowpWhatIf:", "LowpWhatIf:\n      bogus_option: 1", 1))
    out = _dry_run_fp8(small_data, tmp_path, checkout, TE_INSPECT_CONFIG=str(bad))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "bogus_option" in one_error_line(out.stderr)
    # not with the custom recipe: TE's debug path sends its tensors to cuBLAS
    out = _dry_run_fp8(small_data, tmp_path, checkout, TE_INSPECT_CONFIG=str(cfg),
                       CUSTOM_QUANT_TYPE="mxfp8")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "cannot run together" in one_error_line(out.stderr)


def test_example_script_dry_run_prints_the_driver_command(small_data, tmp_path):
    """Without MEGATRON_LM_DIR the printed command runs this project's driver (which turns
    CUSTOM_QUANT_TYPE on TE linears into the same custom recipe: test_training_driver)."""
    out = run([*EXAMPLE, *_example_args(tmp_path, small_data, "fp8")], cwd=tmp_path, timeout=240,
              CUSTOM_QUANT_TYPE="mxfp8", GPUS_PER_NODE="1", MASTER_PORT=str(free_port()),
              IGNORE_RESOURCE_CHECK="1", DRY_RUN="1")
    argv = _dry_run_argv(out)
    assert argv[argv.index("-m", argv.index("training_driver.torchrun")) + 1] == "training_driver.train"
    assert dict(zip(argv, argv[1:]))["--dtype"] == "fp8"


@pytest.mark.parametrize("model,writes", [("tiny", "~2.1 MB"), ("llama32_1b", "")])
def test_example_script_refuses_a_run_the_machine_cannot_hold(small_data, tmp_path, model, writes):
    """The 1B model on a CPU used 16 GB and wrote 2.3 GB of captures before iteration 1
    finished, after only a "very slow" note. The launcher estimates before anything starts;
    here one captured iteration (~2.1 MB for the tiny model in bf16; GBs for the 1B) exceeds a
    1 MB byte budget: one line with the numbers and the override (no note before it), exit 2,
    nothing created."""
    cfg = tmp_path / "capture.yaml"
    cfg.write_text("byte_budget: 1MB\n")
    env = dict(MODEL=model, SEQ_LENGTH="32", GLOBAL_BATCH_SIZE="2", TENSOR_SAVE_ENABLED="true",
               TENSOR_SAVE_DIR=str(tmp_path / "tensors"), TENSOR_SAVE_CONFIG=str(cfg))
    out = run([*EXAMPLE, *_example_args(tmp_path, small_data)], cwd=tmp_path, timeout=120, **env)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    line = one_error_line(out.stderr)
    assert line.startswith("train_llama32_1b_h100_fp8.sh: error: this machine cannot hold the run")
    assert f"capture: one iteration writes {writes}" in line and "more than 1.0 MB" in line
    assert line.endswith("set IGNORE_RESOURCE_CHECK=1 to run anyway")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "tensors").exists()


def test_example_script_and_collector_share_the_input_check(small_data, tmp_path):
    """One check (training_driver.preflight.check_inputs) behind both: a CUSTOM_QUANT_TYPE typo
    gives the same one line, exit 2, from the launcher and from the collector."""
    launcher = run([*EXAMPLE, *_example_args(tmp_path, small_data)], cwd=tmp_path, timeout=120,
                   CUSTOM_QUANT_TYPE="mxfp9")
    collector = run([*COLLECT, "--data-path", small_data["data_path"], "--tokenizer",
                     small_data["tokenizer"], "--quant-type", "mxfp9", "--workdir",
                     str(tmp_path / "w")], cwd=tmp_path, timeout=120)
    assert launcher.returncode == collector.returncode == 2
    lines = [one_error_line(out.stderr).split(": error: ", 1) for out in (launcher, collector)]
    assert [l[0] for l in lines] == ["train_llama32_1b_h100_fp8.sh", "run_wikipedia_tensor_collection.sh"]
    assert lines[0][1] == lines[1][1] and "CUSTOM_QUANT_TYPE='mxfp9' is not a known format" in lines[0][1]


def test_example_script_refuses_an_old_format_tokenizer(small_data, tmp_path):
    old = tmp_path / "old_tokenizer"
    old.mkdir()
    (old / "lowp_bpe_tokenizer.json").write_text('{"format": "megatron-lowp-byte-bpe"}')
    args = _example_args(tmp_path, small_data)
    out = run([*EXAMPLE, *args[:2], str(old), *args[3:]], cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    line = one_error_line(out.stderr)
    assert "old-format tokenizer" in line and "re-run preprocess-corpus" in line


def test_example_script_help_is_the_header_only():
    out = run([*EXAMPLE, "--help"], cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip()
    script = (ROOT / "examples/llama/train_llama32_1b_h100_fp8.sh").read_text().splitlines()
    comments = {l.lstrip("#").strip() for l in script if l.startswith("#")}
    for line in out.stdout.splitlines():       # every help line is a header comment, no code
        assert line.strip() in comments, line
    for word in ("CUSTOM_QUANT_TYPE", "MEGATRON_LM_DIR", "no-gradient-accumulation-fusion",
                 "DTYPE bf16"):
        assert word in out.stdout


def test_summary_counts_and_marks_partial_iterations(tmp_path):
    from tensor_capture.schema import TensorName, build_filename
    from training_driver.collector import format_summary

    specs = [("linear", "forward", 0), ("linear", "backward", 0), ("attention", "forward", 0),
             ("linear", "forward", 1)]
    for counter, (layer_type, op, it) in enumerate(specs):
        name = build_filename(TensorName(layer_type=layer_type, operation=op, tensor_name="input",
                                         quant_type="mxfp4", layer_idx=0, iteration=it, rank=0,
                                         sample_idx=0, timestamp="20250101_000000", counter=counter))
        torch.save({"tensor": torch.ones(4), "metadata": {}}, tmp_path / name)
    (tmp_path / "notes.pt").write_bytes(b"not a capture file")   # ignored: not a schema name
    s = summarize(tmp_path)
    assert (s.files, s.by_layer_type["linear"], s.by_operation["forward"]) == (4, 3, 3)
    assert dict(s.iterations) == {0: 3, 1: 1} and dict(s.by_quant_type) == {"mxfp4": 4}
    text = format_summary(s, tmp_path, finished_iterations=1)
    assert "4 files" in text and "linear                3  ( 75.0%)" in text
    assert "iterations captured: 2 (iteration 0, 1 (partial" in text


def test_launch_scripts_quiet_the_same_megatron_warnings():
    """The scripts' PYTHONWARNINGS default and megatron_env.MEGATRON_IMPORT_WARNINGS (what the
    commands silence before importing megatron) are one list."""
    import re as _re

    from training_driver.megatron_env import MEGATRON_IMPORT_WARNINGS

    want = ",".join(f"ignore:{m}" for m in MEGATRON_IMPORT_WARNINGS)
    for script in ("run_wikipedia_tensor_collection.sh", "examples/llama/train_llama32_1b_h100_fp8.sh"):
        text = (ROOT / script).read_text()
        found = _re.search(r'PYTHONWARNINGS="\$\{PYTHONWARNINGS:-([^}]*)\}"', text)
        assert found and found.group(1) == want, script
