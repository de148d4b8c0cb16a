"""llama-train's settings: the model shapes, ``TrainConfig``, and the checks of a
configuration against the machine (``check_config``) that run before anything is built.

Kept apart from the loop (``training_driver.train``): llama-train and its preflight
(``training_driver.preflight_cli``) both judge a configuration with ``check_config`` here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from lowp_common.cli import UserError
from quant.vocabulary import ENV_QUANT

from .capture import emulation_requested

MODEL_SHAPES: dict[str, dict[str, int]] = {
    # A Llama in miniature: trains in seconds on 2 CPU cores.
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=172, num_attention_heads=4,
                 num_query_groups=2, seq_length=64),
    # Llama 3.2 1B (vocabulary comes from the tokenizer).
    "llama32_1b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                       num_attention_heads=32, num_query_groups=8, seq_length=2048),
}
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "seq_length")
DTYPES = ("fp32", "bf16", "fp8")
# Settings a resumed run must share with its checkpoint.
RESUME_MUST_MATCH = SHAPE_KEYS + ("padded_vocab_size", "tensor_model_parallel_size",
                                  "pipeline_model_parallel_size", "micro_batch_size",
                                  "global_batch_size", "seed")


@dataclass
class TrainConfig:
    data_path: str
    tokenizer: str
    model: str = "tiny"
    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    seq_length: int | None = None
    rotary_base: int = 500000
    make_vocab_size_divisible_by: int = 128
    dtype: str = "fp32"
    transformer_impl: str = "auto"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    micro_batch_size: int = 4
    global_batch_size: int | None = None
    train_iters: int = 20
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 2
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    checkpoint_dir: str | None = None
    save_interval: int = 0
    exit_interval: int = 0
    resume: bool = True
    tensorboard_dir: str | None = None
    log_interval: int = 1
    progress_file: str | None = None
    stop_file: str | None = None
    patched_megatron_workdir: str | None = None
    ignore_resource_check: bool = False
    shape: dict[str, int] = field(default_factory=dict)

    def resolved_shape(self) -> dict[str, int]:
        if self.model not in MODEL_SHAPES:
            raise UserError(f"--model {self.model!r} is unknown: choose one of {', '.join(MODEL_SHAPES)}")
        shape = dict(MODEL_SHAPES[self.model])
        for key in SHAPE_KEYS:
            value = getattr(self, key)
            if value is not None:
                shape[key] = value
        return shape


def _te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def check_config(cfg: TrainConfig, world_size: int, cuda: bool, capture: bool) -> dict[str, Any]:
    """Validate settings against the machine; returns derived values. UserError on a mistake."""
    if cfg.dtype not in DTYPES:
        raise UserError(f"--dtype {cfg.dtype!r} is unknown: choose one of {', '.join(DTYPES)}")
    if cfg.dtype == "fp8" and not (cuda and _te_available()):
        need = "a CUDA GPU" if not cuda else "Transformer Engine (pip install transformer-engine[pytorch])"
        raise UserError(f"--dtype fp8 needs {need}: use --dtype bf16, or CUSTOM_QUANT_TYPE to "
                        "emulate a low-precision format")
    for name in ("train_iters", "micro_batch_size", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "log_interval"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise UserError(f"{world_size} processes cannot be split into tensor parallel {tp} x "
                        f"pipeline parallel {pp}: launch a multiple of {tp * pp} processes")
    if pp > 1 and not cuda:
        raise UserError("--pipeline-model-parallel-size > 1 needs CUDA (megatron-core's pipeline "
                        "schedules allocate on the GPU); use tensor or data parallelism on CPU")
    dp = world_size // (tp * pp)
    shape = cfg.resolved_shape()
    if shape["num_attention_heads"] % tp or shape["num_query_groups"] % tp:
        raise UserError(f"attention heads ({shape['num_attention_heads']}) and query groups "
                        f"({shape['num_query_groups']}) must divide by tensor parallel size {tp}")
    if shape["num_layers"] % pp:
        raise UserError(f"{shape['num_layers']} layers do not split into {pp} pipeline stages")
    gbs = cfg.global_batch_size or cfg.micro_batch_size * dp
    if gbs % (cfg.micro_batch_size * dp):
        raise UserError(f"--global-batch-size {gbs} must be a multiple of micro batch size x "
                        f"data parallel size = {cfg.micro_batch_size * dp}")
    impl = cfg.transformer_impl
    if impl not in ("auto", "local", "te"):
        raise UserError(f"--transformer-impl {impl!r}: choose auto, local or te")
    if impl == "te" and not (cuda and _te_available()):
        raise UserError("--transformer-impl te needs Transformer Engine and a CUDA GPU")
    # Capture hooks sit in megatron's local layers; TE only when asked for or needed by fp8.
    use_te = impl == "te" or cfg.dtype == "fp8" or (
        impl == "auto" and cuda and _te_available() and not capture)
    # CUSTOM_QUANT_TYPE on Transformer Engine linears: TE's custom recipe with our quantizer
    # factory (the emulation of megatron-core's local linears does not reach TE's); a TE too
    # old for it is one line naming the version needed.
    te_recipe = use_te and emulation_requested()
    if te_recipe:
        from te_integration.factory import check_te_version, installed_te_version

        check_te_version(installed_te_version())
    quant_type = os.environ.get(ENV_QUANT, "").strip()
    if quant_type and emulation_requested() and not te_recipe:
        from .preflight import check_recipe_shape

        check_recipe_shape(quant_type, shape, shape["seq_length"] * cfg.micro_batch_size, tp)
    return {"data_parallel_size": dp, "global_batch_size": gbs,
            "num_micro_batches": gbs // (cfg.micro_batch_size * dp), "shape": shape,
            "use_te": use_te, "te_custom_recipe": te_recipe}


def fp8_overrides(dtype: str, te_custom_recipe: bool) -> dict[str, Any]:
    """TransformerConfig fields of the precision: TE's hybrid FP8 recipe for --dtype fp8; with
    CUSTOM_QUANT_TYPE on TE linears, TE's custom recipe with our factory (any --dtype)."""
    if te_custom_recipe:
        from te_integration.factory import FACTORY_PATH

        return dict(fp8="hybrid", fp8_recipe="custom", fp8_quantizer_factory=FACTORY_PATH)
    if dtype == "fp8":
        return dict(fp8="hybrid", fp8_margin=0, fp8_amax_history_len=1024,
                    fp8_amax_compute_algo="max")
    return {}
