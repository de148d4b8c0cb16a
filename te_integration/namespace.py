"""The ``lowp`` debug-API namespace: attention tensors TE never shows, under the same YAML.

Why our own namespace: TE calls the debug API only from its linears; DotProductAttention is
outside it. Our Megatron capture points (tensor_capture.hooks, local and TE attention alike)
see query, key, value and context; when our feature folder is loaded into nvdlfw-inspect they
route them through this namespace (``debug_api.lowp.inspect_tensor_enabled`` /
``inspect_tensor``), so a YAML section's ``lowp:`` block selects attention tensors the way its
``transformer_engine:`` block selects TE's. Without the debug API, capture follows our
environment variables (TENSOR_SAVE_*) as before.

Routing follows TE's namespace (tensor-name parsing, several features per tensor, the
``(bool, next_iteration)`` answers combined to the earliest next iteration).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import inspect_support, names

inspect_support.require()
from nvdlfw_inspect.base import BaseNamespaceAPI  # noqa: E402

#: APIs of the namespace -> the keyword arguments a call must carry
REQUIRED_KWARGS = {"inspect_tensor": ("tensor_name",), "inspect_tensor_enabled": ("tensor_name",)}


class _Defaults:
    """What a tensor no feature selects gets: not enabled, nothing done."""

    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration, **kwargs):
        return False, None

    def inspect_tensor(self, config, layer_name, tensor_name, iteration, **kwargs):
        return None


class LowpAPI(BaseNamespaceAPI):
    """nvdlfw-inspect namespace API of ``lowp`` (registered by debug_features/lowp_namespace.py)."""

    def __init__(self) -> None:
        BaseNamespaceAPI.__init__(self)
        self._default_api_impl = _Defaults()
        self._cacheable_api_kwargs_map = {"inspect_tensor": ["tensor_name"],
                                          "inspect_tensor_enabled": ["tensor_name", "iteration"]}

    def input_assertions_hook(self, api_name, **kwargs):
        for key in REQUIRED_KWARGS.get(api_name, ()):
            assert key in kwargs, f"[lowp] {api_name} needs {key}"
        name = kwargs.get("tensor_name")
        assert name is None or name in names.tensor_names(names.LOWP_NAMESPACE), (
            f"[lowp] unknown tensor {name!r}; valid: "
            f"{', '.join(names.tensor_names(names.LOWP_NAMESPACE))}")

    def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
        return feature_obj.parse_config_and_api(config, tensor_parsing=True, **kwargs)

    def output_assertions_hook(self, api_name, ret, **kwargs):
        if api_name == "inspect_tensor":
            assert ret is None

    def is_multiple_feature_invocation_allowed(self, api_name):
        return api_name in REQUIRED_KWARGS

    def handle_multi_feature_output(self, api_name, multi_feature_outputs, features_to_invoke,
                                    **kwargs):
        if api_name == "inspect_tensor_enabled":
            return combine_enabled(multi_feature_outputs)
        return None

    def end_debug(self):
        from .features import SAVERS

        SAVERS.close()
        uninstall_attention_route()


def combine_enabled(answers: list) -> tuple[bool, Optional[int]]:
    """Several features' (run now, next iteration) -> run if any does, the earliest next."""
    now = any(a[0] if isinstance(a, tuple) else bool(a) for a in answers)
    nexts = [a[1] for a in answers if isinstance(a, tuple) and a[1] is not None]
    return now, (min(nexts) if nexts else None)


def _layer_name(module: Optional[torch.nn.Module], site: Any) -> str:
    """nvdlfw-inspect's name of the module (infer_and_assign_layer_names), else its path."""
    name = getattr(module, "name", None)
    if isinstance(name, str) and name:
        return name
    return getattr(site, "module_path", None) or "core_attention"


def attention_inspector(module: Optional[torch.nn.Module], site: Any, iteration: int,
                        tensors: dict[str, torch.Tensor]) -> None:
    """Called by tensor_capture.hooks for attention tensors: route each through ``lowp``."""
    import nvdlfw_inspect.api as debug_api

    if debug_api.DEBUG_MANAGER is None:
        return
    layer = _layer_name(module, site)
    it = inspect_support.debug_iteration(iteration)
    api = debug_api.lowp
    for name, tensor in tensors.items():
        enabled = api.inspect_tensor_enabled(layer_name=layer, tensor_name=name, iteration=it)
        if enabled[0] if isinstance(enabled, tuple) else enabled:
            api.inspect_tensor(layer_name=layer, tensor_name=name, tensor=tensor, iteration=it,
                               tp_group=None, tp_size=1, rowwise_quantized_tensor=None,
                               columnwise_quantized_tensor=None, quantizer=None)


def install_attention_route() -> None:
    """Our attention capture points call :func:`attention_inspector` from now on."""
    from tensor_capture.saver import set_inspector

    set_inspector(attention_inspector)


def uninstall_attention_route() -> None:
    from tensor_capture.saver import set_inspector

    set_inspector(None)
