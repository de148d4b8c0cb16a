"""nvdlfw-inspect feature file: our features in Transformer Engine's namespace.

Loaded by ``debug_api.initialize(feature_dirs=[this folder, ...])`` (Megatron-LM:
``--tensor-inspect-feature-dirs``); TE's own folder must be listed too, it registers the
``transformer_engine`` namespace these features join. See docs/te.md.
"""
from nvdlfw_inspect.registry import Registry

from te_integration.features import FEATURES
from te_integration.names import TE_NAMESPACE
from te_integration.options import install_validation

for _feature in FEATURES:
    Registry.register_feature(namespace=TE_NAMESPACE)(_feature)
install_validation()
