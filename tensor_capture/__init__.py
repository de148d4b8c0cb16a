"""Capture library behind megatron/core/tensor_saver.py.

Modules: ``schema`` (file names, metadata keys, manifest records: the one place that
knows the on-disk format), ``stats`` (statistics on the tensor's device), ``config``
(environment + YAML settings), ``writer`` (background atomic writer), ``saver``
(TensorSaver, get_tensor_saver: a facade over ``policy`` what to capture, ``record``
metadata + statistics -> record, ``sink`` writer management), ``emulation`` (CUSTOM_QUANT_TYPE fake quantization),
``hooks`` (what the patched Megatron calls: each tensor as a ``schema.CaptureSite``),
``state`` (all process state, the hot-path flag first, with one reset), ``numbering``
(iterations and samples from the schedule wrapper, and the budget stop of every rank),
``patcher`` (the patch tool), ``synthetic`` (realistic runs without Megatron).
Capture never imports plotting. See docs/capture.md.
"""
