"""``quantize``: the public fake-quantization entry point (a quant.quantizer.Quantizer, built
from the options or passed in, plus the optional pre-quantization analysis), and
``quantize_ste`` for a straight-through gradient.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

from .analysis import analyze_quantization, warn_if_underflow
from .formats import FormatSpec
from .quantizer import Quantizer, check_input
from .vocabulary import ENV_ANALYZE, TRUE_WORDS


def _analysis_requested(analyze: Optional[bool]) -> bool:
    if analyze is not None:
        return bool(analyze)
    return os.environ.get(ENV_ANALYZE, "").strip().lower() in TRUE_WORDS


def quantize(x: torch.Tensor, fmt: Union[str, FormatSpec, Quantizer], *,
             generator: Optional[torch.Generator] = None, analyze: Optional[bool] = None,
             **options: Any) -> torch.Tensor:
    """Fake-quantize ``x`` to format ``fmt``: returns the dequantized values, same shape and dtype.

    ``options`` are the Quantizer's fields (quant.quantizer.OPTIONS: block_size, axis, rounding,
    scale_mode, saturate, backend), or ``fmt`` is a configured Quantizer (built once by a caller
    that quantizes many tensors alike) and carries them; passing others then is an error.

    rounding: nearest_even | nearest_away | toward_zero | stochastic, plus hybrid for hifp8
    (None = the format's default: nearest_away for hifp8, nearest_even otherwise); the random
    modes draw uniform noise from ``generator``. scale_mode: floor | ceil | rceil (MX only).
    saturate: clamp finite overflow (and +-Inf) to +-max_normal; False gives the format's overflow
    encoding (Inf, or NaN for E4M3). analyze: print the pre-quantization underflow warning
    (default: environment variable QUANT_ANALYZE=1); it never changes the result.
    backend: auto | torch | triton (see quant.backends; auto = Triton for CUDA tensors when
    Triton imports); every backend gives the same bits, random rounding included for the same
    generator state.
    The result is a new contiguous tensor without autograd history (see ``quantize_ste``).
    """
    check_input(x)
    q = Quantizer.resolve(fmt, **options)
    y = q(x, generator)
    if y.numel() and _analysis_requested(analyze):
        warn_if_underflow(analyze_quantization(x.detach(), q, quantized=y))
    return y


class _QuantizeSTE(torch.autograd.Function):
    """Forward: exactly quantize(x); backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt, kwargs: dict) -> torch.Tensor:
        return quantize(x, fmt, **kwargs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def quantize_ste(x: torch.Tensor, fmt: Union[str, FormatSpec], **kwargs) -> torch.Tensor:
    """Fake quantization with a straight-through gradient: forward quantize(x), backward
    identity (for quantization-aware training and emulated GEMM operands).

    An autograd Function rather than ``x + (q - x).detach()``: that sum is not q when x is
    Inf (Inf - Inf = NaN) or far above a saturated q (q is lost to rounding).
    """
    if x.requires_grad and torch.is_grad_enabled():
        return _QuantizeSTE.apply(x, fmt, kwargs)
    return quantize(x, fmt, **kwargs)
