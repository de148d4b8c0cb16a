"""Bring up megatron-core's parallel state and build Llama-style GPT models.

One place for the narrow shims CPU-only torch forces on megatron-core 0.16.1, so every caller (capture tests,
the training driver, the layer-wise precision diff) runs the same setup:

- ``torch.cuda.current_device`` answers the CPU device when CUDA is absent,
  because attention, RoPE and TP gathers ask it for a device to allocate on;
- ``model_parallel_cuda_manual_seed(..., inference_rng_tracker=True)``, because
  the default RNG tracker calls CUDA RNG functions;
- ``use_cpu_initialization=True`` in the TransformerConfig;
- one intra-op thread per process (two on two cores made step times bimodal).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

#: Warnings megatron-core gives at import or model build that say nothing on this project's
#: machines (TE/apex absent is the expected case on CPU; a cuda_graph_scope default). The one
#: list: the commands call quiet_megatron_warnings() before they import megatron, and the launch
#: scripts export the same as PYTHONWARNINGS (tests/test_training_scripts.py checks they agree).
MEGATRON_IMPORT_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                            "full scope is deprecated")


def quiet_megatron_warnings() -> None:
    """Silence MEGATRON_IMPORT_WARNINGS (and, without CUDA, advice about CUDA streams)."""
    import warnings

    messages = list(MEGATRON_IMPORT_WARNINGS)
    if not torch.cuda.is_available():  # advice about CUDA streams, moot on CPU
        messages.append("When using async grad allreduce")
    for message in messages:
        warnings.filterwarnings("ignore", message=message)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply_cpu_shims() -> None:
    """Patch the one CUDA query megatron-core makes on CPU; no-op when CUDA exists."""
    if cuda_available():
        return
    if getattr(torch.cuda.current_device, "_cpu_shim", False):
        return

    def _current_device_cpu():  # named so tracebacks show where it came from
        return torch.device("cpu")

    _current_device_cpu._cpu_shim = True
    torch.cuda.current_device = _current_device_cpu


def free_port() -> int:
    """An unused loopback TCP port for a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    rank: int = 0,
    world_size: int = 1,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    master_port: int | None = None,
) -> None:
    """Initialize torch.distributed (gloo on CPU, nccl on CUDA) and Megatron's model-parallel groups.

    Reads MASTER_ADDR/MASTER_PORT from the environment when set (torchrun), else uses
    127.0.0.1 and ``master_port``.
    """
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_shims()
    if not cuda_available():
        torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        backend = "nccl" if cuda_available() else "gloo"
        if cuda_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not cuda_available())
    torch.manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class LlamaShape:
    """Shape of a Llama-style decoder. Defaults: a tiny model that trains on 2 CPU cores."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 172
    num_attention_heads: int = 4
    num_query_groups: int = 2
    vocab_size: int = 256
    seq_length: int = 32
    rotary_base: int = 500000
    extra_config: dict[str, Any] = field(default_factory=dict)


def llama_config(shape: LlamaShape, params_dtype: torch.dtype = torch.float32, **overrides: Any):
    """TransformerConfig for RMSNorm + SwiGLU + RoPE + GQA, untied embeddings, no biases."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=not cuda_available(),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    kwargs.update(shape.extra_config)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_llama_model(shape: LlamaShape, params_dtype: torch.dtype = torch.float32,
                      use_te: bool = False, pre_process: bool | None = None,
                      post_process: bool | None = None, **config_overrides: Any):
    """A GPTModel with the local (or, when asked and available, Transformer Engine) layer spec.

    Call after :func:`init_distributed`. The model is on CUDA when available, else CPU.
    ``pre_process``/``post_process`` default to whether this rank is the first/last pipeline
    stage (both True without pipeline parallelism).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron.core import parallel_state

    config = llama_config(shape, params_dtype, **config_overrides)
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=parallel_state.is_pipeline_last_stage() if post_process is None else post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=shape.rotary_base,
    )
    if cuda_available():
        model = model.cuda()
    return model


def causal_inputs(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """position_ids and the boolean causal mask GPTModel.forward expects for [b, s] tokens."""
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), diagonal=1)
    return {"position_ids": position_ids, "attention_mask": mask.view(1, 1, s, s)}
