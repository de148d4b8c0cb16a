"""Helpers of the Transformer Engine integration tests: the debug API set up with our feature
folder and the TE namespace stand-in, and a TE 2.20 linear's debug-API calls."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
FEATURE_DIR = ROOT / "te_integration" / "debug_features"
STANDIN_DIR = Path(__file__).resolve().parent / "te_standin"


class RecordingLogger:
    """An nvdlfw-inspect statistics logger (BaseLogger's log_scalar) that keeps every value."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, int], float] = {}

    def log_scalar(self, name: str, value: float, iteration: int, **kwargs: Any) -> None:
        self.values[(name, iteration)] = value


def make_logger():
    from nvdlfw_inspect.logging import BaseLogger

    class _Logger(RecordingLogger, BaseLogger):
        pass

    return _Logger()


def initialize(config: Path | dict, log_dir: Path, logger=None) -> None:
    """debug_api.initialize with our folder and the stand-in (as TE's folder would be listed)."""
    import nvdlfw_inspect.api as debug_api

    debug_api.initialize(config_file=config if isinstance(config, dict) else str(config),
                         feature_dirs=[str(FEATURE_DIR), str(STANDIN_DIR)],
                         statistics_logger=logger, log_dir=str(log_dir))


def te_linear_calls(layer_name: str, tensors: dict[str, torch.Tensor], iteration: int,
                    quantizer: Optional[Any] = None) -> dict[str, Any]:
    """What a TE 2.20 linear does per tensor: ask inspect_tensor_enabled, then call
    inspect_tensor with TE's keyword arguments. Returns each tensor's enabled answer."""
    import nvdlfw_inspect.api as debug_api

    answers = {}
    for name, tensor in tensors.items():
        answer = debug_api.transformer_engine.inspect_tensor_enabled(
            layer_name=layer_name, tensor_name=name, iteration=iteration)
        answers[name] = answer
        if answer[0] if isinstance(answer, tuple) else answer:
            debug_api.transformer_engine.inspect_tensor(
                layer_name=layer_name, tensor=tensor, tensor_name=name, iteration=iteration,
                tp_group=None, tp_size=1, columnwise_quantized_tensor=None,
                rowwise_quantized_tensor=None, quantizer=quantizer)
    return answers


def attention_worker(rank: int, patched_dir: str, port: int, out_dir: str, config: str) -> None:
    """The tiny Llama (real megatron-core, patched tree) with the debug API initialised from
    ``config``: one forward + backward; writes the logged values and the route's state."""
    import os
    import sys

    for var in ("TENSOR_SAVE_ENABLED", "CUSTOM_QUANT_TYPE", "TENSOR_SAVE_CONFIG",
                "TENSOR_SAVER_ITERATION", "TENSOR_SAVE_DIR"):
        os.environ.pop(var, None)
    sys.path.insert(0, patched_dir)
    from capture_helpers import _fwd_bwd, tiny_model_and_tokens

    from training_driver import megatron_env as me

    me.init_distributed(rank, 1, tensor_model_parallel_size=1, master_port=port)
    import nvdlfw_inspect.api as debug_api

    import megatron.core
    from megatron.core import tensor_saver as ts

    out = Path(out_dir)
    result: dict = {"megatron_file": megatron.core.__file__}
    try:
        model, tokens = tiny_model_and_tokens(me)
        result["active_before"] = bool(ts.STATE.active)
        logger = make_logger()
        debug_api.initialize(config_file=config, feature_dirs=[str(FEATURE_DIR), str(STANDIN_DIR)],
                             statistics_logger=logger, log_dir=str(out / "logs"))
        debug_api.infer_and_assign_layer_names(model)
        result["active_during"] = bool(ts.STATE.active)
        result["loss"], _ = _fwd_bwd(model, tokens)
        debug_api.step()
        result["values"] = {f"{name}@{it}": float(v) for (name, it), v in logger.values.items()}
        debug_api.end_debug()
        result["active_after"] = bool(ts.STATE.active)
        result["inspector_after"] = ts.STATE.inspector is None
    finally:
        torch.save(result, out / "result.pt")
        me.destroy_distributed()
