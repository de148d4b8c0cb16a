"""Transformer Engine integration: our formats inside TE layers, our numerics in TE's debug API.

- :mod:`te_integration.factory`: the quantizer factory of TE's custom recipe
  (``CustomRecipe(qfactory=...)``; Megatron-LM ``--fp8-recipe custom --fp8-quantizer-factory
  te_integration.factory.quantizer_factory``): CUSTOM_QUANT_TYPE picks the format;
- ``te_integration/debug_features/``: the feature folder nvdlfw-inspect loads
  (``feature_dirs=[...]``): block-scale statistics, what-if quantization and capture in TE's
  ``transformer_engine`` namespace, and the ``lowp`` namespace for attention tensors TE never
  shows; in a released Megatron-LM run (no ``--tensor-inspect*`` flags: those are Megatron-LM
  pull request #3811 only) through :mod:`te_integration.megatron_lm`;
- :mod:`te_integration.te_patches`: the two TE calls (fused wgrad accumulation, bias gradient)
  made to take our quantizer.

Nothing here imports Transformer Engine at import time; see docs/te.md.
"""
