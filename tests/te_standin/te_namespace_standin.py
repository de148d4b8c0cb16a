"""A narrow stand-in for Transformer Engine's ``transformer_engine`` debug-API namespace.

Transformer Engine cannot be installed on a CPU machine, and its namespace file
(transformer_engine/debug/features/api.py) imports TE. This file registers a namespace of the
same name that routes the way TE 2.20's does, for the calls our features answer:
``inspect_tensor_enabled(layer_name, tensor_name, iteration)`` -> bool or
``(bool, next_iteration)`` (several features: any runs, the earliest next iteration) and
``inspect_tensor(layer_name, tensor_name, tensor, iteration, tp_group, tp_size,
rowwise_quantized_tensor, columnwise_quantized_tensor, quantizer)`` -> None (several features
run in turn), each routed by the tensor name through the feature's
``parse_config_and_api(config, gemm_parsing=..., tensor_parsing=..., **kwargs)``. Nothing else
(no modify_tensor, no FP8 GEMM switches, no statistics buffers). Test-only: it lives outside the
shipped feature folder, because nvdlfw-inspect executes every .py file in a feature folder.
"""
from nvdlfw_inspect.base import BaseNamespaceAPI
from nvdlfw_inspect.registry import Registry

#: TE 2.20's call -> the keyword arguments routing needs (tensor name; gemm for gemm calls)
ROUTED_BY = {
    "inspect_tensor": ("tensor_name",),
    "inspect_tensor_enabled": ("tensor_name",),
    "modify_tensor_enabled": ("tensor_name", "gemm"),
    "modify_tensor": ("tensor_name", "gemm"),
    "fp8_gemm_enabled": ("gemm",),
}
#: TE 2.20's answers when no feature is enabled for the tensor
_DEFAULT_ANSWERS = {"inspect_tensor_enabled": (False, None), "modify_tensor_enabled": (False, None),
                    "fp8_gemm_enabled": (True, None)}


class _StandinDefaults:
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        return _DEFAULT_ANSWERS["inspect_tensor_enabled"]

    def modify_tensor_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        return _DEFAULT_ANSWERS["modify_tensor_enabled"]

    def fp8_gemm_enabled(self, config, layer_name, gemm, iteration):
        return _DEFAULT_ANSWERS["fp8_gemm_enabled"]

    def inspect_tensor(self, config, layer_name, tensor_name, tensor, rowwise_quantized_tensor,
                       columnwise_quantized_tensor, quantizer, iteration, tp_group, tp_size=1):
        return None


@Registry.register_namespace_api(namespace="transformer_engine")
class TransformerEngineNamespaceStandin(BaseNamespaceAPI):
    def __init__(self):
        BaseNamespaceAPI.__init__(self)
        self._default_api_impl = _StandinDefaults()
        self._cacheable_api_kwargs_map = {
            "inspect_tensor": ["tensor_name"],
            "inspect_tensor_enabled": ["tensor_name", "iteration"],
            "modify_tensor_enabled": ["tensor_name"],
            "fp8_gemm_enabled": ["gemm"],
        }

    def input_assertions_hook(self, api_name, **kwargs):
        for key in ROUTED_BY[api_name]:
            assert key in kwargs, f"stand-in: {api_name} needs {key}"

    def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
        keys = ROUTED_BY[api_name]
        return feature_obj.parse_config_and_api(config, gemm_parsing="gemm" in keys,
                                                tensor_parsing="tensor_name" in keys, **kwargs)

    def output_assertions_hook(self, api_name, ret, **kwargs):
        if api_name.endswith("_enabled"):
            assert isinstance(ret, (bool, tuple)), f"{api_name} returned {ret!r}"
        if api_name == "inspect_tensor":
            assert ret is None

    def is_multiple_feature_invocation_allowed(self, api_name):
        return api_name in ("inspect_tensor", "inspect_tensor_enabled", "fp8_gemm_enabled")

    def handle_multi_feature_output(self, api_name, outputs, features_to_invoke, **kwargs):
        if api_name.endswith("_enabled"):
            if all(isinstance(o, tuple) for o in outputs):
                nexts = [o[1] for o in outputs if o[1] is not None]
                return any(o[0] for o in outputs), (min(nexts) if nexts else None)
            return any(bool(o) for o in outputs), None
        return None
