"""training_driver.preflight: the one memory / capture-size estimate, checked with numbers, and
the refusal (one line, exit 2) of llama-train and the collector before anything starts."""
from __future__ import annotations

import pytest
from training_helpers import small_data  # noqa: F401  (the session's dataset fixture)

from lowp_common.cli import UserError
from tensor_capture.config import load_config
from training_driver import preflight
from training_driver.preflight import (
    RunEstimate,
    capture_elements,
    check_resources,
    estimate_run,
    padded_vocab_size,
    parameter_count,
)
from training_driver.train import MODEL_SHAPES

TINY = MODEL_SHAPES["tiny"]                 # h 64, ffn 172, 4 heads, 2 groups (kv 32), 2 layers
ONE_B = MODEL_SHAPES["llama32_1b"]


def test_parameter_count_is_llama_32_1b_published_count():
    """With tied embeddings Llama 3.2 1B has 1,235,814,400 parameters (its model card); the
    driver unties the output layer: one more 128256 x 2048 matrix."""
    assert parameter_count(ONE_B, 128256, tied=True) == 1_235_814_400
    assert parameter_count(ONE_B, 128256) == 1_235_814_400 + 128256 * 2048


def test_parameter_count_by_hand_for_the_tiny_model():
    # per layer: qkv 64x(64+2*32) + proj 64x64 + fc1 64x344 + fc2 172x64 + 2 norms of 64
    per_layer = 64 * 128 + 64 * 64 + 64 * 344 + 172 * 64 + 128
    assert parameter_count(TINY, 384) == 2 * per_layer + 2 * 384 * 64 + 64 == 140_096


def test_padded_vocab():
    assert padded_vocab_size(384, 128, 1) == 384
    assert padded_vocab_size(385, 128, 2) == 512
    assert padded_vocab_size(128256, 128, 1) == 128256


def test_memory_parts_per_dtype():
    n = parameter_count(TINY, 384)
    fp32 = estimate_run(TINY, 384, "fp32", 4, 1)
    bf16 = estimate_run(TINY, 384, "bf16", 4, 1)
    assert (fp32.weights, fp32.optimizer) == (8 * n, 8 * n)         # weights + grads; 2 moments
    assert (bf16.weights, bf16.optimizer) == (12 * n, 8 * n)        # + fp32 master w and grads
    assert fp32.runtime == preflight.RUNTIME_BYTES
    # activations of one micro-batch: T = 4 x 64 tokens
    tokens, h, f, kv = 4 * 64, 64, 172, 32
    per_layer = tokens * (8 * h + 2 * (h + 2 * kv) + 3 * f) * 4 + 8 * 4 * 64 * 64 * 4
    assert fp32.activations == int(2 * per_layer + 3 * tokens * 384 * 4)
    four = estimate_run(TINY, 384, "fp32", 4, 1, ranks=4)
    assert four.memory == 4 * fp32.memory and four.capture == 0


def test_capture_size_of_the_tiny_model_matches_the_files_it_writes():
    """Worked by hand for tiny, fp32, micro-batch 4 x seq 32 = 128 tokens, vocab 384: per
    linear forward input + weight + output, backward grad_output + weight + grad_input +
    grad_weight; per attention q, k, v, context and their gradients, and the probabilities of
    2 heads x 32 query rows x 32 keys (2 x 2,048 elements over the 2 layers). 1,056,256
    elements = 4.2 MB, what the saver's stop line reports for such a run (4.2 MB of files on
    rank 0)."""
    capture = load_config(env={"TENSOR_SAVE_ENABLED": "true"})
    tiny32 = dict(TINY, seq_length=32)
    assert capture_elements(tiny32, 384, 128, capture, layers=2) == 1_056_256
    est = estimate_run(tiny32, 384, "fp32", 4, 1, capture=capture)
    assert est.capture_per_rank == 4 * 1_056_256
    assert estimate_run(tiny32, 384, "fp32", 4, 3, capture=capture).capture_per_rank == 3 * 4 * 1_056_256
    assert estimate_run(tiny32, 384, "bf16", 4, 1, capture=capture).capture_per_rank == 2 * 1_056_256


@pytest.mark.parametrize("yaml_env,smaller", [
    ({"stats_only": "true"}, 0),
    ({"operations": "forward"}, None),
    ({"max_rows": "16"}, None),
    ({"layers": "0"}, None),
])
def test_capture_filters_shrink_the_estimate(tmp_path, yaml_env, smaller):
    cfg = tmp_path / "capture.yaml"
    cfg.write_text("".join(f"{k}: {v}\n" for k, v in yaml_env.items()))
    full = capture_elements(TINY, 384, 256, load_config(env={"TENSOR_SAVE_ENABLED": "true"}), 2)
    part = capture_elements(TINY, 384, 256, load_config(env={"TENSOR_SAVE_ENABLED": "true",
                                                             "TENSOR_SAVE_CONFIG": str(cfg)}), 2)
    assert part == smaller if smaller is not None else 0 < part < full


def _estimate(memory: int, capture: int = 0, ranks: int = 1) -> RunEstimate:
    return RunEstimate(parameters=975_000_000, weights=memory, optimizer=0, activations=0,
                       runtime=0, capture_per_rank=capture, ranks=ranks)


def test_check_refuses_with_the_numbers_and_the_flag():
    with pytest.raises(preflight.UserError) as err:
        check_resources(_estimate(36 * 10**9), "pass --ignore-resource-check to run anyway",
                        memory=(24 * 10**9, "available memory"))
    line = str(err.value)
    assert "\n" not in line
    assert "975 M parameters" in line and "needs ~36.0 GB, 24.0 GB available memory" in line
    assert line.endswith("pass --ignore-resource-check to run anyway")


def test_check_refuses_a_capture_the_budget_cannot_hold():
    with pytest.raises(preflight.UserError, match=r"one iteration writes ~92.0 GB per rank, more "
                                                  r"than 41.0 GB \(half the disk\)"):
        check_resources(_estimate(10**9, capture=92 * 10**9), "X",
                        memory=(24 * 10**9, "available memory"),
                        budget=(41 * 10**9, "half the disk"))


def test_check_passes_and_says_the_estimate():
    said = []
    check_resources(_estimate(10**9, capture=10**6), "X", memory=(24 * 10**9, "available memory"),
                    budget=(41 * 10**9, "half the disk"), say=said.append)
    assert len(said) == 1 and "memory ~1.0 GB" in said[0] and "~1.0 MB per rank" in said[0]


def test_on_a_gpu_memory_is_per_rank():
    est = _estimate(8 * 30 * 10**9, ranks=8)       # 30 GB per rank, 8 ranks
    check_resources(est, "X", memory=(78 * 10**9, "free on each GPU"))
    with pytest.raises(preflight.UserError, match="needs ~240.0 GB, 78.0 GB available"):
        check_resources(est, "X", memory=(78 * 10**9, "available memory"))


@pytest.fixture
def small_memory(monkeypatch):
    """A machine with 1 GB of memory, whatever this one has."""
    monkeypatch.setattr(preflight, "available_memory", lambda: (10**9, "available memory"))


def test_llama_train_refuses_before_building_the_model(small_data, small_memory, capsys, monkeypatch):
    from training_driver import megatron_env
    from training_driver.train import main

    def never(*a, **k):
        raise AssertionError("the model was to be built")

    monkeypatch.setattr(megatron_env, "init_distributed", never)
    monkeypatch.delenv("MASTER_PORT", raising=False)    # not a port another test left behind
    code = main(["--data-path", small_data["data_path"], "--tokenizer", small_data["tokenizer"],
                 "--model", "llama32_1b", "--seq-length", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("llama-train: error: this machine cannot hold the run (975 M parameters)")
    assert "1.0 GB available memory" in err[0] and "--ignore-resource-check" in err[0]


def test_collector_refuses_before_training_starts(small_data, small_memory, capsys, tmp_path, monkeypatch):
    import subprocess

    from training_driver import collector

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("training was started"))
    monkeypatch.delenv("MASTER_PORT", raising=False)    # not a port another test left behind
    code = collector.main(["--data-path", small_data["data_path"], "--tokenizer",
                           small_data["tokenizer"], "--model", "llama32_1b", "--workdir",
                           str(tmp_path / "w"), "--tensor-dir", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot hold the run" in err[0], err
    assert not (tmp_path / "t").exists() and not (tmp_path / "w" / "patched_megatron").exists()


# ---- Megatron-LM recipes on the launcher: native where the GPU has them, else emulated ----------
def test_every_megatron_recipe_maps_to_its_emulation_or_runs_natively():
    from quant.recipes import MEGATRON_EMULATION

    assert set(preflight.NATIVE_CAPABILITY) == {(f, v) for f, t in MEGATRON_EMULATION.items()
                                                for v in t}
    for (flag, value), need in preflight.NATIVE_CAPABILITY.items():
        kw = {"fp8_recipe": value} if flag == "--fp8-recipe" else {"fp4_recipe": value}
        want = MEGATRON_EMULATION[flag][value]
        # DTYPE bf16 always emulates (also on a GPU that has the recipe)
        assert preflight.recipe_plan(**kw, dtype="bf16", capability=(10, 0),
                                     te_available=True) == ("emulate", want)
        assert preflight.recipe_plan(**kw, dtype="fp8", capability=need,
                                     te_available=True) == ("native", f"{flag} {value}")
        with pytest.raises(UserError, match=f"use DTYPE bf16 to emulate it exactly "
                                            f"\\(CUSTOM_QUANT_TYPE={want}\\)"):
            preflight.recipe_plan(**kw, dtype="fp8", capability=(need[0], need[1] - 1)
                                  if need[1] else (need[0] - 1, 9), te_available=True)
        with pytest.raises(UserError, match="needs Transformer Engine"):
            preflight.recipe_plan(**kw, dtype="fp8", capability=need, te_available=False)
    # the hardware facts the table encodes: an H100 (9.0) lacks MXFP8 and NVFP4
    assert preflight.recipe_plan("mxfp8", None, "bf16", (9, 0), True) == ("emulate", "te_mxfp8")
    with pytest.raises(UserError, match="compute capability 10.0, which this GPU"):
        preflight.recipe_plan(None, "nvfp4", "fp8", (9, 0), True)
    assert preflight.recipe_plan(None, None, "fp8", None, False) == ("none", "-")


@pytest.mark.parametrize("fp8,fp4,message", [
    ("mxfp9", None, "FP8_RECIPE=mxfp9 is unknown: choose one of delayed, tensorwise, blockwise, "
                    "mxfp8"),
    ("mxfp8", "nvfp4", "both set"),
])
def test_recipe_plan_bad_input(fp8, fp4, message):
    with pytest.raises(UserError, match=message):
        preflight.recipe_plan(fp8, fp4, "bf16", None, False)


def test_recipe_shape_check_names_the_dimension_and_multiple():
    tiny = MODEL_SHAPES["tiny"]                       # ffn 172: not a multiple of 16
    with pytest.raises(UserError, match=r"CUSTOM_QUANT_TYPE=te_nvfp4 needs a multiple of 16 "
                                        r"along each fprop .*--ffn-hidden-size / TP .* is 172"):
        preflight.check_recipe_shape("te_nvfp4", tiny, 64)
    ok = {**tiny, "ffn_hidden_size": 160}
    preflight.check_recipe_shape("te_nvfp4", ok, 64)
    preflight.check_recipe_shape("te_fp8_tensorwise", tiny, 63)    # per tensor: any shape
    with pytest.raises(UserError, match="tokens per micro-batch .* is 48"):
        preflight.check_recipe_shape("te_mxfp8", ok, 48)
    with pytest.raises(UserError, match=r"--ffn-hidden-size / TP \(linear_fc2 input\) is 40"):
        preflight.check_recipe_shape("te_nvfp4", ok, 64, tp=4)    # 160 / 4 per rank
