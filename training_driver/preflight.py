"""Checks before training starts: capture settings, tokenizer/data, and whether the machine can
hold the run (memory) and its capture (disk).

Why: the 1B model once ran on a CPU; it used 16 GB of memory and wrote 2.3 GB of captures
before iteration 1 finished, after only a "very slow" note. A run that cannot fit should stop
in its first second with the numbers, not after an hour (or with the machine swapping). The one
estimate is :func:`estimate_run`; llama-train, the collector and the launcher
(``python -m training_driver.preflight``) all call :func:`check_resources`.

The estimate is deliberately rough (within tens of percent on the CPU runs measured, see
docs/training.md): parameters are counted exactly for the Llama shape; per parameter the bytes
of :data:`BYTES_PER_PARAMETER` (weights, gradients, fp32 master copies, AdamW's two moments);
activations of one micro-batch per layer from the tensors the local layers keep for backward;
a fixed runtime per process; capture from the tensors the hooks save per linear and attention
call (every micro-batch), after the capture config's filters that change sizes.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from lowp_common import human_bytes
from lowp_common.cli import UserError
from quant.vocabulary import DGRAD, FPROP, LINEAR_GEMMS, WGRAD
from tensor_capture.schema import LAYER_TYPES, OPERATIONS

#: Bytes per parameter, by training dtype: (model weights, model gradients, fp32 master weights
#: and gradients, AdamW's exp_avg + exp_avg_sq). fp32 trains on the model's own parameters;
#: bf16 (and fp8, whose Transformer Engine recipe runs on a bf16 model) keeps fp32 copies
#: (training_driver.optim.MasterParams).
BYTES_PER_PARAMETER: dict[str, tuple[int, int, int, int]] = {
    "fp32": (4, 4, 0, 8),
    "bf16": (2, 2, 8, 8),
    "fp8": (2, 2, 8, 8),
}
#: Bytes of one activation (and one captured tensor element), by training dtype.
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}
#: Resident memory of one training process before the model: Python, torch, megatron-core
#: (measured about 0.48 GB for the tiny model on CPU).
RUNTIME_BYTES = 500 * 10**6
#: Bytes kept per attention score (head x query x key) per layer and micro-batch: the local
#: (unfused) attention's softmax works in fp32 (input and output, 8 bytes) in fp32 and bf16 runs
#: alike (measured: within 6 % of the peak memory of CPU runs with seq 1024, both dtypes).
ATTENTION_SCORE_BYTES = 8

#: The environment variable the collector and the launcher set for the training processes once
#: they have checked (so each rank does not repeat the check and its line).
CHECKED_ENV = "LOWP_RESOURCES_CHECKED"
#: What llama-train and the collector say after the numbers when a run does not fit.
REMEDY = ("a smaller --model, --seq-length or --micro-batch-size fits, or pass "
          "--ignore-resource-check to run anyway")


@dataclass(frozen=True)
class RunEstimate:
    """What one training run needs on one node. Bytes are per node (all its ranks) unless
    named per rank."""

    parameters: int                 # of the whole model
    weights: int                    # model weights + gradients + master copies
    optimizer: int                  # AdamW moments
    activations: int
    runtime: int
    capture_per_rank: int           # tensor files of one captured iteration, per rank
    ranks: int                      # ranks on this node

    @property
    def memory(self) -> int:
        return self.weights + self.optimizer + self.activations + self.runtime

    @property
    def capture(self) -> int:
        return self.capture_per_rank * self.ranks

    def summary(self) -> str:
        per = f" on {self.ranks} ranks" if self.ranks > 1 else ""
        return (f"{count_text(self.parameters)} parameters; memory ~{human_bytes(self.memory)}{per} "
                f"(weights, gradients and master copies {human_bytes(self.weights)}, optimizer "
                f"{human_bytes(self.optimizer)}, activations {human_bytes(self.activations)}, "
                f"runtime {human_bytes(self.runtime)})")


def count_text(n: float) -> str:
    """A parameter count for people: 140.3 k, 12.0 M, 1.50 B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f}"


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """The embedding rows megatron-core allocates: the vocabulary padded to a multiple of
    ``divisible_by x tensor_parallel`` (the driver's and Megatron-LM's rule)."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


def _kv_size(shape: Mapping[str, int]) -> int:
    return shape["hidden_size"] // shape["num_attention_heads"] * shape["num_query_groups"]


def parameter_count(shape: Mapping[str, int], vocab_size: int, tied: bool = False) -> int:
    """Parameters of the Llama GPT (RMSNorm, SwiGLU, GQA, no biases; untied embedding and output
    layer unless ``tied``). With Llama 3.2 1B's shape, its 128256 tokens and ``tied=True``
    this is its published 1,235,814,400."""
    h, f = shape["hidden_size"], shape["ffn_hidden_size"]
    kv = _kv_size(shape)
    per_layer = h * (h + 2 * kv) + h * h + h * 2 * f + f * h + 2 * h   # qkv, proj, fc1, fc2, norms
    return shape["num_layers"] * per_layer + (1 if tied else 2) * vocab_size * h + h


def _linears(shape: Mapping[str, int]) -> list[tuple[int, int]]:
    """(in, out) of the linears of one transformer layer: qkv, proj, fc1 (SwiGLU: 2 x ffn), fc2."""
    h, f = shape["hidden_size"], shape["ffn_hidden_size"]
    return [(h, h + 2 * _kv_size(shape)), (h, h), (h, 2 * f), (f, h)]


def _rows(rows: int, max_rows: int | None) -> int:
    return rows if max_rows is None else min(rows, max_rows)


def capture_elements(shape: Mapping[str, int], vocab_size: int, tokens: int,
                     capture: Any | None, layers: int) -> int:
    """Elements the capture hooks save for one micro-batch of ``tokens`` tokens over ``layers``
    transformer layers (and the output layer), after the config's size filters: stats_only,
    layer_types, operations, layers, max_rows, save_quantized, probs_heads / probs_rows. Name filters (tensor_names,
    module_regex) are not modelled: the estimate is then an upper bound."""
    if capture is None or getattr(capture, "stats_only", False):
        return 0
    ops = set(getattr(capture, "operations", OPERATIONS))
    types = set(getattr(capture, "layer_types", LAYER_TYPES))
    max_rows = getattr(capture, "max_rows", None)
    rows = _rows(tokens, max_rows)

    def linear(i: int, o: int) -> int:
        weight = _rows(o, max_rows) * i            # a weight [out, in]: rows = out
        n = 0
        if "forward" in ops:                         # input, weight, output
            n += rows * i + weight + rows * o
        if "backward" in ops:                        # grad_output, weight, grad_input, grad_weight
            n += rows * o + weight + rows * i + weight
        return n

    h, kv = shape["hidden_size"], _kv_size(shape)
    attention = (2 * rows * h + 2 * rows * kv) * len(ops & set(OPERATIONS))
    heads = min(getattr(capture, "probs_heads", 0), shape["num_attention_heads"])
    if heads and "forward" in ops:                  # the probabilities' sample: heads x rows x keys
        s = shape["seq_length"]
        attention += heads * len(range(0, s, -(-s // capture.probs_rows))) * s
    per_layer = (sum(linear(i, o) for i, o in _linears(shape)) if "linear" in types else 0) + (
        attention if "attention" in types else 0)
    selected = layers if getattr(capture, "layers", None) is None else min(layers, len(capture.layers))
    total = selected * per_layer
    if "linear" in types and getattr(capture, "layers", None) is None:
        total += linear(h, vocab_size)               # the output layer (no layer index)
    if getattr(capture, "save_quantized", False) and getattr(capture, "emulating", False):
        total *= 2                                   # the operand the GEMM saw, too
    return total


def capture_sites(shape: Mapping[str, int], capture: Any, layers: int) -> int:
    """Tensors the capture hooks take per micro-batch over ``layers`` transformer layers (and
    the output layer), after the layer_types / operations / layers / probs_heads /
    save_quantized filters: the flight recorder's slots per micro-batch (an upper bound when
    name filters apply)."""
    ops = set(getattr(capture, "operations", OPERATIONS))
    types = set(getattr(capture, "layer_types", LAYER_TYPES))
    linear = 3 * ("forward" in ops) + 4 * ("backward" in ops)
    attention = (4 + (getattr(capture, "probs_heads", 0) > 0)) * ("forward" in ops) + (
        4 * ("backward" in ops))
    per_layer = (len(_linears(shape)) * linear if "linear" in types else 0) + (
        attention if "attention" in types else 0)
    selected = layers if getattr(capture, "layers", None) is None else min(layers, len(capture.layers))
    total = selected * per_layer + (linear if "linear" in types and getattr(
        capture, "layers", None) is None else 0)
    if getattr(capture, "save_quantized", False) and getattr(capture, "emulating", False):
        total *= 2
    return total


def check_recorder(capture: Any, shape: Mapping[str, int], num_micro_batches: int,
                   pipeline_parallel: int = 1) -> int | None:
    """The flight recorder's memory per rank (tensor_capture.recorder.ring.ring_bytes over
    sites x micro-batches), UserError (one line) when it exceeds ``recorder_memory``; None when
    the recorder is off."""
    from tensor_capture.config import MODE_RECORDER
    from tensor_capture.recorder.ring import ring_bytes

    if capture is None or getattr(capture, "mode", None) != MODE_RECORDER:
        return None
    sites = capture_sites(shape, capture, shape["num_layers"] // pipeline_parallel)
    need = ring_bytes(sites * num_micro_batches, capture.recorder_window, capture.recorder_every)
    if need > capture.recorder_memory:
        raise UserError(
            f"tensor capture: the flight recorder needs ~{human_bytes(need)} per rank ({sites} "
            f"tensors x {num_micro_batches} micro-batches x {capture.recorder_window} + "
            f"{2 * capture.recorder_every} iterations), more than recorder_memory="
            f"{human_bytes(capture.recorder_memory)}: raise recorder_memory or lower "
            "recorder_window in TENSOR_SAVE_CONFIG, or select fewer tensors (layers, "
            "operations, layer_types)")
    return need


def estimate_run(shape: Mapping[str, int], vocab_size: int, dtype: str, micro_batch_size: int,
                 num_micro_batches: int, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 ranks: int = 1, capture: Any | None = None) -> RunEstimate:
    """The memory and capture size of one run on one node of ``ranks`` processes (the one
    estimate; see the module docstring for what it counts). ``vocab_size``: padded."""
    if dtype not in BYTES_PER_PARAMETER:
        raise UserError(f"dtype {dtype!r}: choose one of {', '.join(BYTES_PER_PARAMETER)}")
    tp, pp = tensor_parallel, pipeline_parallel
    params = parameter_count(shape, vocab_size)
    per_rank_params = params / (tp * pp)
    w, g, master, adam = BYTES_PER_PARAMETER[dtype]
    act = ACTIVATION_BYTES[dtype]
    s, h, f = shape["seq_length"], shape["hidden_size"], shape["ffn_hidden_size"]
    tokens = micro_batch_size * s
    layers = shape["num_layers"] // pp
    # kept for backward per layer: norm inputs/outputs, q/k/v (before and after RoPE), context,
    # projection and residual outputs, fc1 output, the SwiGLU product; plus the attention scores
    per_layer = tokens * (8 * h + 2 * (h + 2 * _kv_size(shape)) + 3 * f) / tp * act + (
        ATTENTION_SCORE_BYTES * shape["num_attention_heads"] * s * s * micro_batch_size / tp)
    logits = 3 * tokens * vocab_size / tp * 4       # fp32 logits, softmax and its gradient
    in_flight = min(pp, num_micro_batches)           # 1F1B keeps up to pp micro-batches
    activations = in_flight * layers * per_layer + logits
    captured = capture_elements(shape, vocab_size, tokens, capture, layers)
    return RunEstimate(
        parameters=params,
        weights=int(ranks * per_rank_params * (w + g + master)),
        optimizer=int(ranks * per_rank_params * adam),
        activations=int(ranks * activations),
        runtime=ranks * RUNTIME_BYTES,
        capture_per_rank=int(num_micro_batches * captured * act / tp),
        ranks=ranks)


# ---------------------------------------------------------------------------------------------
# What the machine has
# ---------------------------------------------------------------------------------------------
def available_memory() -> tuple[int, str]:
    """(bytes, where) the run may use: free memory of GPU 0 with CUDA, else the host's
    MemAvailable (/proc/meminfo; sysconf where there is none)."""
    try:
        import torch

        if torch.cuda.is_available():
            free, _total = torch.cuda.mem_get_info(0)
            return int(free), "free on each GPU"
    except Exception:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available memory"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available memory"


def check_resources(estimate: RunEstimate, remedy: str, *, memory: tuple[int, str] | None = None,
                    budget: tuple[float, str] | None = None, on_gpu: bool | None = None,
                    say: Any = None) -> None:
    """UserError (one line: the numbers, then ``remedy``: the command's own settings that make
    the run smaller and its flag that skips this check) when the machine cannot hold the run,
    else ``say`` one line with the estimate.

    ``memory``: (bytes, where) as :func:`available_memory`; ``budget``: (bytes per rank,
    where) one captured iteration may take (the capture's byte budget, by default a share of
    the free disk: tensor_capture.budget), None without capture. On a GPU the comparison is per
    rank (each has its own GPU), on a CPU per node.
    """
    have, where = available_memory() if memory is None else memory
    if on_gpu is None:
        on_gpu = where.endswith("GPU")
    need = estimate.memory // estimate.ranks if on_gpu else estimate.memory
    problems = []
    if need > have:
        per = " per GPU" if on_gpu else ""
        problems.append(f"memory: needs ~{human_bytes(need)}{per}, {human_bytes(have)} {where}")
    capture_line = ""
    if budget is not None and estimate.capture_per_rank:
        limit, why = budget
        capture_line = (f"; one captured iteration ~{human_bytes(estimate.capture_per_rank)} per "
                        f"rank (budget {human_bytes(limit)}: {why})")
        if estimate.capture_per_rank > limit:
            problems.append(f"capture: one iteration writes ~{human_bytes(estimate.capture_per_rank)} "
                            f"per rank, more than {human_bytes(limit)} ({why}); capture "
                            "less (layers, max_rows, stats_only in TENSOR_SAVE_CONFIG) or free disk")
    if problems:
        raise UserError(f"this machine cannot hold the run ({count_text(estimate.parameters)} "
                        f"parameters): " + "; ".join(problems) + f"; {remedy}")
    if say is not None:
        say(f"resources: {estimate.summary()}; {human_bytes(have)} {where}{capture_line}")


def capture_config(env: Mapping[str, str]) -> Any | None:
    """The capture settings in ``env`` when capture saves anything, else None (UserError on a
    mistake in them)."""
    from tensor_capture.config import ConfigError, load_config

    try:
        config = load_config(env=env)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    return config if config.enabled else None


def capture_budget(config: Any | None, env: Mapping[str, str],
                   ranks: int) -> tuple[float, str] | None:
    """(bytes per rank one captured iteration may take, why), or None when no files are
    written: the byte budget as the saver will apply it (tensor_capture.budget.bounded, with
    ``ranks`` local ranks); an unlimited one means the free disk."""
    from tensor_capture.budget import bounded, free_bytes

    if config is None or config.stats_only:
        return None
    config, notes = bounded(config, dict(env, LOCAL_WORLD_SIZE=str(ranks)))
    budget = config.byte_budget
    if budget is None or budget == math.inf:
        try:
            return free_bytes(config.save_dir) / ranks, f"free disk under {config.save_dir}"
        except OSError:
            return None
    return budget, notes.get("byte_budget", "byte_budget in TENSOR_SAVE_CONFIG")


def check_training_run(cfg: Any, derived: Mapping[str, Any], vocab_size: int, ranks: int,
                       remedy: str = "", env: Mapping[str, str] | None = None,
                       say: Any = None) -> RunEstimate:
    """One llama-train run (its TrainConfig, check_config's derived values, the padded
    vocabulary) estimated and checked against this machine (:func:`check_resources`).
    ``ranks``: training processes on this node."""
    env = os.environ if env is None else env
    capture = capture_config(env)
    ring = check_recorder(capture, derived["shape"], derived["num_micro_batches"],
                          cfg.pipeline_model_parallel_size)
    if ring is not None and say is not None:
        say(f"flight recorder: ring and buffer ~{human_bytes(ring)} per rank (recorder_memory "
            f"{human_bytes(capture.recorder_memory)})")
    estimate = estimate_run(derived["shape"], vocab_size, cfg.dtype, cfg.micro_batch_size,
                            derived["num_micro_batches"], cfg.tensor_model_parallel_size,
                            cfg.pipeline_model_parallel_size, ranks, capture)
    check_resources(estimate, remedy or REMEDY, budget=capture_budget(capture, env, ranks), say=say)
    return estimate


# ---------------------------------------------------------------------------------------------
# The inputs check (the launcher runs it through training_driver.preflight_cli)
# ---------------------------------------------------------------------------------------------
def check_inputs(tokenizer: str, data_path: str,
                 env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Capture settings (a CUSTOM_QUANT_TYPE typo), the data files, the tokenizer (an
    old-format directory) and whether the data was made with it; the collector's and the
    launcher's one check. UserError on a mistake; returns (capture on?, the emulated format or
    '')."""
    from tensor_capture.config import ConfigError, load_config

    from .capture import capture_requested
    from .data.samples import check_data_prefix, check_tokenizer_matches
    from .data.tokenizer import load_tokenizer

    env = dict(os.environ if env is None else env)
    try:
        quant = load_config(env=env).quant_type or ""
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    check_data_prefix(data_path)
    check_tokenizer_matches(data_path, load_tokenizer(tokenizer))
    return capture_requested(env), quant


# ---- Megatron-LM's --fp8-recipe / --fp4-recipe: native on the GPU that has it, else emulated ----
#: (flag, value) -> the smallest CUDA compute capability Transformer Engine runs it on natively
#: (FP8 per-tensor: Ada/Hopper; FP8 1x128 blocks: Hopper; MXFP8 and NVFP4: Blackwell)
NATIVE_CAPABILITY: dict[tuple[str, str], tuple[int, int]] = {
    ("--fp8-recipe", "delayed"): (8, 9), ("--fp8-recipe", "tensorwise"): (8, 9),
    ("--fp8-recipe", "blockwise"): (9, 0), ("--fp8-recipe", "mxfp8"): (10, 0),
    ("--fp4-recipe", "nvfp4"): (10, 0)}


def recipe_plan(fp8_recipe: str | None = None, fp4_recipe: str | None = None, dtype: str = "bf16",
                capability: tuple[int, int] | None = None,
                te_available: bool = False) -> tuple[str, str]:
    """How the launcher runs a Megatron-LM recipe: ("native", "--fp8-recipe mxfp8") with DTYPE
    fp8 on a GPU that has it (and Transformer Engine), ("emulate", "te_mxfp8") with DTYPE bf16
    (CUSTOM_QUANT_TYPE, quant.recipes), ("none", "-") when no recipe is asked for. UserError
    for an unknown value, both flags at once, or DTYPE fp8 where the GPU lacks the recipe."""
    from quant.recipes import MEGATRON_EMULATION

    asked = [(f, v) for f, v in (("--fp8-recipe", fp8_recipe), ("--fp4-recipe", fp4_recipe)) if v]
    if not asked:
        return "none", "-"
    if len(asked) > 1:
        raise UserError("FP8_RECIPE and FP4_RECIPE are both set: give one of them")
    flag, value = asked[0]
    env_name = "FP8_RECIPE" if flag == "--fp8-recipe" else "FP4_RECIPE"
    table = MEGATRON_EMULATION[flag]
    if value not in table:
        raise UserError(f"{env_name}={value} is unknown: choose one of {', '.join(table)}")
    need = NATIVE_CAPABILITY[(flag, value)]
    native = te_available and capability is not None and tuple(capability) >= need
    if dtype != "fp8":
        return "emulate", table[value]
    if not native:
        where = (f"this GPU (compute capability {capability[0]}.{capability[1]})" if capability
                 else "this machine (no CUDA GPU)")
        lacks = "Transformer Engine" if capability and tuple(capability) >= need else \
            f"compute capability {need[0]}.{need[1]}"
        raise UserError(f"{env_name}={value} with DTYPE fp8 needs {lacks}, which {where} lacks: "
                        f"use DTYPE bf16 to emulate it exactly (CUSTOM_QUANT_TYPE={table[value]})")
    return "native", f"{flag} {value}"


def _reduction_dims(shape: Mapping[str, int], tokens: int,
                    tp: int = 1) -> list[tuple[str, str, int]]:
    """(what, GEMM, length of its reduction axis on one rank) for the Llama's linears (SwiGLU,
    GQA; column-parallel outputs and row-parallel inputs split over ``tp`` ranks)."""
    h, f = shape["hidden_size"], shape["ffn_hidden_size"]
    kv = _kv_size(shape)
    return [("--hidden-size (linear_qkv, linear_fc1 inputs)", FPROP, h),
            ("--ffn-hidden-size / TP (linear_fc2 input)", FPROP, f // tp),
            ("--hidden-size / TP (linear_proj input)", FPROP, h // tp),
            ("linear_qkv output / TP (hidden + 2 x key/value width)", DGRAD, (h + 2 * kv) // tp),
            ("linear_fc1 output / TP (2 x --ffn-hidden-size)", DGRAD, 2 * f // tp),
            ("--hidden-size (linear_proj, linear_fc2 outputs)", DGRAD, h),
            ("tokens per micro-batch (--seq-length x --micro-batch-size)", WGRAD, tokens)]


def check_recipe_shape(recipe_name: str, shape: Mapping[str, int], tokens: int,
                       tp: int = 1) -> None:
    """UserError naming the first GEMM dimension the emulated recipe cannot tile (a recipe that
    needs a multiple of 16 or 32 along a reduction axis), before the model is built."""
    from quant.recipes import ROLES, get_recipe

    try:
        recipe = get_recipe(recipe_name)
    except ValueError:
        return                  # the capture config's check names the unknown recipe
    need = {g: max((recipe.quantizer(t, g).multiple or 1) for t, gg in ROLES if gg == g)
            for g in LINEAR_GEMMS}
    for what, gemm, n in _reduction_dims(shape, tokens, tp):
        if n % need[gemm]:
            raise UserError(f"CUSTOM_QUANT_TYPE={recipe.name} needs a multiple of {need[gemm]} "
                            f"along each {gemm} GEMM's reduction axis; {what} is {n}: choose "
                            f"sizes that are multiples of {need[gemm]}")
