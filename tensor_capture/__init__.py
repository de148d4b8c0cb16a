"""Capture library behind megatron/core/tensor_saver.py.

Modules: ``schema`` (file names, metadata keys, manifest records: the one place that
knows the on-disk format). Capture never imports plotting.
"""
