"""quant: the numerics core (pure torch): format specs, exact fake quantizers, analysis, metrics.

Public API (other packages rely on these names):
    get_format(name) -> FormatSpec, FORMATS, FormatSpec, ROUNDING_MODES, SCALE_MODES,
    quantize(x, fmt, *, generator=None, analyze=None, **options) -> Tensor (options: the
             fields of quant.quantizer.Quantizer, quant.quantizer.OPTIONS: block_size, axis,
             rounding, scale_mode, saturate, backend),
    quantize_ste(x, fmt, **kw), analyze_quantization(x, fmt, ...) -> QuantAnalysis,
    metrics (mse, rmse, mae, max_abs_error, relative_error, cosine_similarity, psnr, sqnr).
Training recipes (Transformer Engine's, and every format as a trivial one):
    quant.recipes.quantize_operand(x, recipe, tensor, gemm, *, generator=None, state=None),
    quant.recipes.RECIPES, quant.recipes.DelayedScalingState.
See docs/quant.md.

The format table is imported eagerly and needs no torch (``import quant.formats`` stays light,
so command-line ``--help`` and option tables can derive their format lists from it); the torch
parts load on first use.
"""
import importlib

from .formats import (
    FORMATS,
    HIF8_ROUNDING_MODES,
    ROUNDING_MODES,
    SCALE_MODES,
    FormatSpec,
    get_format,
)

#: public name -> the submodule that defines it (loaded on first access)
_LAZY = {"metrics": None, "QuantAnalysis": "analysis", "analyze_quantization": "analysis",
         "warn_if_underflow": "analysis", "quantize": "fakequant", "quantize_ste": "fakequant"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'quant' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value

__all__ = ["FORMATS", "FormatSpec", "get_format", "ROUNDING_MODES", "HIF8_ROUNDING_MODES",
           "SCALE_MODES", "quantize",
           "quantize_ste", "analyze_quantization", "QuantAnalysis", "warn_if_underflow",
           "metrics"]
