"""Capture library behind megatron/core/tensor_saver.py.

Modules: ``schema`` (file names, metadata keys, manifest records: the one place that
knows the on-disk format), ``stats`` (statistics on the tensor's device), ``config``
(environment + YAML settings), ``writer`` (background atomic writer), ``saver``
(TensorSaver, get_tensor_saver: a facade over ``policy`` what to capture, ``record``
metadata + statistics -> record, ``sink`` writer management), ``emulation`` (CUSTOM_QUANT_TYPE fake quantization),
``hooks`` (what the patched Megatron calls), ``state`` (the hot-path flag),
``patcher`` (the patch tool), ``synthetic`` (realistic runs without Megatron).
Capture never imports plotting. See docs/capture.md.
"""
