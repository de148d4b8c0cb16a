"""A CPU stand-in for ``transformer_engine_torch``, TE's compiled extension, and nothing else.

Why: TE's published wheel holds all of ``transformer_engine/pytorch/**`` as Python, but its
compiled extension (and the CUDA libraries ``transformer_engine.common`` loads) cannot load on
a CPU. tests/te_real/boot.py puts this module in its place so TE's own Linear /
LayerNormLinear code runs. Only the calls our tests reach are implemented, in torch, each as
the C++ behaves for our custom quantizers; every other name is a ``Missing`` placeholder that
TE may read at import time (enum members, class names) but that raises when called, so a test
never passes through a path the stub only pretends to run.
"""
from __future__ import annotations

import enum
from typing import Any

import torch


class Missing:
    """A name of the extension this stub does not implement: calling it raises. TE's attention
    code reads enum members (NVTE_QKV_Layout.*, ...) at import time as ints; each name gets a
    distinct opaque int (no attention runs here, so no value is ever interpreted)."""

    _known: dict = {}

    def __new__(cls, name: str) -> "Missing":
        if name not in cls._known:
            obj = super().__new__(cls)
            obj._name = name
            obj._int = 1000 + len(cls._known)
            cls._known[name] = obj
        return cls._known[name]

    def __getattr__(self, attr: str) -> "Missing":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __int__(self) -> int:
        return self._int

    __index__ = __int__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"transformer_engine_torch.{self._name} is not in the CPU test "
                                  "stub (tests/te_real/tex_stub.py)")

    def __repr__(self) -> str:
        return f"<stub transformer_engine_torch.{self._name}>"

    def __mro_entries__(self, bases):   # TE subclasses some extension classes at import time
        return (object,)


class DType(enum.IntEnum):
    """The members the extension exports of transformer_engine::DType (values as in TE's
    common header)."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


class FP8FwdTensors(enum.IntEnum):
    """Forward FP8 meta slots (values as in TE's C++)."""

    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM1_OUTPUT = 2
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM2_OUTPUT = 5
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7
    GEMM3_OUTPUT = 8


class FP8BwdTensors(enum.IntEnum):
    """Backward FP8 meta slots (values as in TE's C++)."""

    GRAD_OUTPUT1 = 0
    GRAD_INPUT1 = 1
    GRAD_OUTPUT2 = 2
    GRAD_INPUT2 = 3
    GRAD_OUTPUT3 = 4
    GRAD_INPUT3 = 5


class NVTE_Fused_Attn_Backend(enum.IntEnum):
    """cuDNN attention sub-backends (values as in TE's C++); attention is never run here."""

    NVTE_No_Backend = -1
    NVTE_F16_arbitrary_seqlen = 1
    NVTE_FP8 = 2


class CommOverlapType(enum.IntEnum):
    """Userbuffers overlap kinds (never used here: no tensor-parallel overlap on a CPU)."""

    RS = 0
    AG = 1


def _is_native_quantizer(quantizer: Any) -> bool:
    """What the C++ ``convert_quantizer`` accepts: TE's own quantizer classes (or None)."""
    if quantizer is None:
        return True
    native = ("Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer",
              "Float8BlockQuantizer", "NVFP4Quantizer")
    return type(quantizer).__name__ in native and type(quantizer).__module__.startswith(
        "transformer_engine.")


def _refuse_foreign(quantizer: Any) -> None:
    if not _is_native_quantizer(quantizer):
        # the C++ raises a RuntimeError from its quantizer conversion for any other class
        raise RuntimeError(f"Unexpected type for quantizer: {type(quantizer).__name__} "
                           "(transformer_engine_torch accepts only TE's own quantizers)")


def bgrad_quantize(grad_output: torch.Tensor, quantizer: Any):
    """[bias gradient, quantized grad_output]; like the C++, only for TE's own quantizers."""
    _refuse_foreign(quantizer)
    raise NotImplementedError("transformer_engine_torch.bgrad_quantize with a native quantizer "
                              "is not in the CPU test stub")


def quantize(tensor: torch.Tensor, quantizer: Any, output: Any = None, noop: Any = None):
    """TE's C++ quantize: like the C++, only TE's own quantizers."""
    _refuse_foreign(quantizer)
    raise NotImplementedError("transformer_engine_torch.quantize with a native quantizer "
                              "is not in the CPU test stub")


def generic_gemm(A, transa, B, transb, out, quantizer, out_dtype, bias, bias_type, gelu, gelu_in,
                 grad, workspace, workspace_size, accumulate, use_split_accumulator, **kwargs):
    """cuBLAS GEMM, for high-precision torch tensors only: ``op(B) @ op(A)`` (op: transpose
    when its flag is set) over the operands flattened to 2-D, + bias; with ``grad`` and a bias,
    also the bias gradient of B (TE's fused wgrad + bgrad). Quantized operands are refused, a
    custom tensor as the C++ refuses any class it does not know."""
    for t in (A, B):
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(f"Unexpected tensor type in GEMM: {type(t).__name__} "
                               "(transformer_engine_torch knows only torch tensors and TE's own "
                               "quantized storages)")
        if type(t).__module__.startswith("transformer_engine."):
            raise NotImplementedError("quantized GEMM operands are not in the CPU test stub")
    if quantizer is not None or gelu or kwargs.get("comm_overlap") is not None:
        raise NotImplementedError("generic_gemm with an output quantizer, GELU or overlap is not "
                                  "in the CPU test stub")
    a2, b2 = A.reshape(-1, A.shape[-1]).float(), B.reshape(-1, B.shape[-1]).float()
    d = (b2.t() if transb else b2) @ (a2.t() if transa else a2)
    bias_grad = None
    if bias is not None and bias.numel():
        if grad:
            bias_grad = b2.sum(0).to(bias.dtype)
        else:
            d = d + bias.float()
    dtype = _TORCH_DTYPE[int(out_dtype)] if out_dtype is not None else A.dtype
    if not transb and B.dim() > 2:
        d = d.reshape(*B.shape[:-1], d.shape[-1])
    if out is None:
        return d.to(dtype), bias_grad, None, None
    if accumulate:
        out.add_(d.reshape(out.shape).to(out.dtype))
    else:
        out.copy_(d.reshape(out.shape))
    return out, bias_grad, None, None


def _grouped(*args: Any, **kwargs: Any):
    raise RuntimeError("transformer_engine_torch grouped GEMM called with custom tensors: TE's "
                       "C++ grouped GEMM takes only its own quantized tensors")


te_general_grouped_gemm = _grouped


def get_cublasLt_version() -> int:
    return 120000


def get_cudnn_version() -> int:
    return 90000


def get_num_cublas_streams() -> int:
    return 4


#: DType value -> the torch dtype of a high-precision output
_TORCH_DTYPE = {int(DType.kFloat32): torch.float32, int(DType.kFloat16): torch.float16,
                int(DType.kBFloat16): torch.bfloat16}


def split_quantize(tensor: torch.Tensor, split_sections: Any, quantizers: Any, *args: Any, **kw: Any):
    """Grouped quantization: like the C++, only TE's own quantizers."""
    for q in quantizers:
        _refuse_foreign(q)
    raise NotImplementedError("transformer_engine_torch.split_quantize with native quantizers "
                              "is not in the CPU test stub")


def layernorm_fwd(inp, weight, bias, eps, ln_out, quantizer, otype, sm_margin,
                  zero_centered_gamma):
    """LayerNorm forward in float32: (out, mean, rsigma); quantizing output only natively."""
    x = inp.float()
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    rsigma = torch.rsqrt(var + eps)
    gamma = weight.float() + (1 if zero_centered_gamma else 0)
    y = (x - mu) * rsigma * gamma + (bias.float() if bias is not None else 0)
    y = y.to(otype if isinstance(otype, torch.dtype) else _TORCH_DTYPE[int(otype)])
    if quantizer is not None:
        _refuse_foreign(quantizer)
        raise NotImplementedError("layernorm_fwd with a native quantizer is not in the stub")
    return y, mu.reshape(-1), rsigma.reshape(-1)


def layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
    """LayerNorm backward in float32 from the saved mean and 1/sigma: (dx, dgamma, dbeta)."""
    n = x.shape[-1]
    xf, dzf = x.float().reshape(-1, n), dz.float().reshape(-1, n)
    rs = rsigma.float().reshape(-1, 1)
    xhat = (xf - mu.float().reshape(-1, 1)) * rs
    gdz = dzf * (gamma.float() + (1 if zero_centered_gamma else 0))
    dx = rs * (gdz - gdz.mean(-1, keepdim=True) - xhat * (gdz * xhat).mean(-1, keepdim=True))
    return (dx.reshape(x.shape).to(x.dtype), (dzf * xhat).sum(0).to(gamma.dtype),
            dzf.sum(0).to(gamma.dtype))


# names TE's Python takes with ``from transformer_engine_torch import *`` (module __getattr__
# does not feed a star import) and uses at import time; never run here
rmsnorm_fwd = Missing("rmsnorm_fwd")
rmsnorm_bwd = Missing("rmsnorm_bwd")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return Missing(name)
