"""lowp-attribute: which GEMM of which layers costs a low-precision format's loss gap, and the
precision plan (quant.precision_plan) that closes it at the least high-precision compute."""
