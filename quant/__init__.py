"""quant: the numerics core (pure torch): format specs, exact fake quantizers, analysis, metrics.

Public API (other packages rely on these names):
    get_format(name) -> FormatSpec, FORMATS, FormatSpec, ROUNDING_MODES, SCALE_MODES,
    quantize(x, fmt, *, block_size=None, axis=-1, rounding=None, scale_mode="floor",
             saturate=True, generator=None, analyze=None) -> Tensor,
    quantize_ste(x, fmt, **kw), analyze_quantization(x, fmt, ...) -> QuantAnalysis,
    metrics (mse, rmse, mae, max_abs_error, relative_error, cosine_similarity, psnr, sqnr).
See docs/quant.md.
"""
from . import metrics
from .analysis import QuantAnalysis, analyze_quantization, warn_if_underflow
from .formats import (FORMATS, HIF8_ROUNDING_MODES, ROUNDING_MODES, SCALE_MODES, FormatSpec,
                      get_format)
from .quantize import quantize, quantize_ste

__all__ = ["FORMATS", "FormatSpec", "get_format", "ROUNDING_MODES", "HIF8_ROUNDING_MODES",
           "SCALE_MODES", "quantize",
           "quantize_ste", "analyze_quantization", "QuantAnalysis", "warn_if_underflow",
           "metrics"]
