"""Vector bit casts in Inductor's C++ kernels: float32 <-> int32 reinterpretation in registers.

Why: every quantizer reads exponents from a float's bits (``x.view(torch.int32)``) and builds
powers of two from bits. Inductor's C++ backend (torch 2.13) has no vector form of that bit
cast: it stores the vector to a stack array, bit-casts lane by lane and loads it back, which
stalls on every vector (the narrow stores cannot forward to the wide load) and made the compiled
quantizers compute-bound at about a third of memory speed on a CPU. ATen's
``at::vec::cast<To>(Vectorized<From>)`` is the same reinterpretation of the same bits (one
register move on x86), so emitting it changes no value, only the speed.

:func:`install` swaps the one code generator (vectors of one register each, same-width types;
anything else keeps Inductor's own), once per process, and only where Inductor is the version
that has the hook; the kernels quant.accel compiles are checked bit for bit against the eager
ones either way. :data:`CACHE_TAG` goes into Inductor's cache key of those kernels, so a kernel
generated without the fix and cached on disk is not reused.
"""
from __future__ import annotations

#: Inductor cache-key tag of kernels compiled with the vector bit cast (bump on a change here)
CACHE_TAG = "quant-vec-bitcast-1"


def _vector_bitcast(original):
    from torch._inductor.codegen.cpp_utils import DTYPE_TO_CPP
    from torch._inductor.virtualized import V

    def to_dtype_bitcast(x, dtype, src_dtype):
        kernel = V.kernel
        if (dtype.itemsize == src_dtype.itemsize and dtype in DTYPE_TO_CPP
                and kernel._get_num_vectors(dtype) == 1
                and kernel._get_num_vectors(src_dtype) == 1):
            return f"at::vec::cast<{DTYPE_TO_CPP[dtype]}>({x})"
        return original(x, dtype, src_dtype)

    to_dtype_bitcast.quant_vector_bitcast = True
    return to_dtype_bitcast


def install() -> bool:
    """Emit vector bit casts in Inductor's C++ kernels from now on (idempotent); False when
    this torch has no such hook (the kernels stay as Inductor writes them: correct, slower)."""
    try:
        from torch._inductor.codegen import cpp
        current = cpp.CppVecOverrides.__dict__["to_dtype_bitcast"].__func__
        if getattr(current, "quant_vector_bitcast", False):
            return True
        patched = _vector_bitcast(current)
    except (ImportError, AttributeError, KeyError):
        return False
    cpp.CppVecOverrides.to_dtype_bitcast = staticmethod(patched)
    return True
