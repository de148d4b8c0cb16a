"""nvdlfw-inspect feature file: the ``lowp`` namespace (attention query / key / value /
context from our Megatron capture points) and our features in it. Loading it routes our
attention capture points through the debug API until ``debug_api.end_debug()``."""
from nvdlfw_inspect.registry import Registry

from te_integration.features import FEATURES
from te_integration.names import LOWP_NAMESPACE
from te_integration.namespace import LowpAPI, install_attention_route
from te_integration.options import install_validation

Registry.register_namespace_api(namespace=LOWP_NAMESPACE)(LowpAPI)
for _feature in FEATURES:
    Registry.register_feature(namespace=LOWP_NAMESPACE)(_feature)
install_validation()
install_attention_route()
