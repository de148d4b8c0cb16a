"""In-tree entry point for tensor capture and CUSTOM_QUANT_TYPE emulation in Megatron.

``patches/apply_patches.sh`` copies this file into a Megatron tree next to the patched
``transformer/dot_product_attention.py`` and ``tensor_parallel/layers.py``. The logic lives
in the installed ``tensor_capture`` package; this module only re-exports it so the patched
files need one import. The hot path checks ``STATE.active`` and nothing else.
"""
from tensor_capture.config import CaptureConfig, ConfigError, load_config
from tensor_capture.hooks import (
    attention_forward,
    linear_backward_post,
    linear_dgrad,
    linear_forward,
    linear_wgrad,
    quantize_probs,
    register_model,
    te_attention_forward,
)
from tensor_capture.saver import (
    TensorSaver,
    configure,
    get_tensor_saver,
    reset_tensor_saver,
    save_attention_tensors,
    save_linear_tensors,
    save_tensor,
)
from tensor_capture.state import STATE, env_requests_activity


# PLACEHOLDERS (wt-patcher): the runtime branch (wt-runtime) replaces these two definitions by
# re-exports of tensor_capture.hooks.linear_wgrad_fused and tensor_capture.numbering.wrap_schedule
# (CONTRACT_capture.md). They exist only so the patched schedules.py / layers.py import.
def linear_wgrad_fused(ctx, grad_output, total_input, main_grad):  # type: ignore[no-untyped-def]
    """Placeholder: the fused weight-gradient hook is not implemented in this build."""
    raise NotImplementedError("linear_wgrad_fused is a placeholder in this build of "
                              "megatron/core/tensor_saver.py (the runtime branch provides it)")


def wrap_schedule(func):  # type: ignore[no-untyped-def]
    """Placeholder: returns the schedule unchanged (no automatic numbering yet)."""
    return func


TENSOR_SAVER_PATCH_VERSION = 1

__all__ = [
    "STATE", "TensorSaver", "CaptureConfig", "ConfigError", "load_config", "configure",
    "get_tensor_saver", "reset_tensor_saver", "save_tensor", "save_attention_tensors",
    "save_linear_tensors", "register_model", "linear_forward", "linear_dgrad", "linear_wgrad",
    "linear_backward_post", "attention_forward", "te_attention_forward", "quantize_probs",
    "linear_wgrad_fused", "wrap_schedule",
]

# Validate the environment when the patched Megatron is imported, so a bad
# CUSTOM_QUANT_TYPE or TENSOR_SAVE_* value fails at start, not mid-run.
if env_requests_activity():
    get_tensor_saver()
