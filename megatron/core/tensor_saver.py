"""In-tree entry point for tensor capture and CUSTOM_QUANT_TYPE emulation in Megatron.

``patches/apply_patches.sh`` copies this file into a Megatron tree next to the patched
``transformer/dot_product_attention.py`` and ``tensor_parallel/layers.py``. The logic lives
in the installed ``tensor_capture`` package; this module only re-exports it so the patched
files need one import. The hot path checks ``STATE.active`` and nothing else.
"""
import os

from tensor_capture.config import CaptureConfig, ConfigError, load_config
from tensor_capture.hooks import (
    attention_forward,
    attention_probs,
    linear_backward_post,
    linear_dgrad,
    linear_forward,
    linear_wgrad,
    linear_wgrad_fused,
    quantize_probs,
    te_attention_forward,
)
from tensor_capture.numbering import resume_at, wrap_schedule
from tensor_capture.saver import (
    TensorSaver,
    configure,
    get_tensor_saver,
    reset_tensor_saver,
    save_attention_tensors,
    save_linear_tensors,
    save_tensor,
)
from tensor_capture.sites import register_model
from tensor_capture.state import STATE, env_requests_activity

__all__ = [
    "STATE", "TensorSaver", "CaptureConfig", "ConfigError", "load_config", "configure",
    "get_tensor_saver", "reset_tensor_saver", "save_tensor", "save_attention_tensors",
    "save_linear_tensors", "register_model", "linear_forward", "linear_dgrad", "linear_wgrad",
    "linear_backward_post", "attention_forward", "te_attention_forward", "quantize_probs",
    "attention_probs",
    "linear_wgrad_fused", "wrap_schedule", "resume_at",
]

# Validate the environment when the patched Megatron is imported, so a bad
# CUSTOM_QUANT_TYPE or TENSOR_SAVE_* value fails at start, not mid-run. Not again in a child
# of a process that did (Megatron's torch_dist checkpoint writer re-imports pretrain_gpt.py,
# and so this module): it never trains, and its start line read as if capture restarted.
_STARTED_IN = "LOWP_CAPTURE_STARTED_IN_PID"
if env_requests_activity() and os.environ.get(_STARTED_IN) != str(os.getppid()):
    get_tensor_saver()
    os.environ[_STARTED_IN] = str(os.getpid())
