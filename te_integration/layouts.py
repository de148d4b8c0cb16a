"""Which GEMM each layout of a Transformer Engine operand feeds: the one table the quantizer
factory reads (a slot's format) and the tests hold the emulated GEMM's blocking axis to.

Its own module, standard library only, so that the factory loads without torch and neither of
the two imports the other.
"""
from __future__ import annotations

#: (QuantizerRole.tensor_type, layout) -> the GEMM that layout of the operand feeds (TE's
#: convention: an input's rowwise layout feeds fprop, its columnwise layout wgrad)
LAYOUT_GEMM: dict[tuple[str, str], str] = {
    ("input", "rowwise"): "fprop", ("input", "columnwise"): "wgrad",
    ("weight", "rowwise"): "fprop", ("weight", "columnwise"): "dgrad",
    ("grad_output", "rowwise"): "dgrad", ("grad_output", "columnwise"): "wgrad"}
