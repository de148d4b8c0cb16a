"""Megatron-LM's own training loop: the ``pretrain_gpt.py`` command line our runs translate to
(``command``).
"""
