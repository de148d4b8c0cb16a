"""Format specifications: one frozen spec object per format name, built from one table.

Why a table: every quantizer, the analysis and the docs read the same facts (bits, bias, range,
Inf/NaN encodings, block size, scale format), so a new format is one row, not a new if-branch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ROUNDING_MODES = ("nearest_even", "nearest_away", "toward_zero", "stochastic")
SCALE_MODES = ("floor", "ceil", "rceil")
#: the MX scale mode of the format definition (OCP v1.0), used wherever none is chosen
DEFAULT_SCALE_MODE = SCALE_MODES[0]

# Scaling families (how a block / tensor scale is chosen before the element cast).
SCALING_NONE = "none"      # plain element cast (fp8_e4m3, bf16, int8 ...)
SCALING_MX = "mx"          # OCP MX: E8M0 power-of-two scale per block
SCALING_NVFP4 = "nvfp4"    # E4M3 scale per block of 16 times an FP32 per-tensor scale
SCALING_TENSOR = "tensor"  # FP32 per-tensor amax scale (Transformer Engine current scaling)
SCALING_IDENTITY = "identity"  # fp32: no quantization


@dataclass(frozen=True)
class FormatSpec:
    """Facts of one format. For scaled formats the numeric facts are those of the element type.

    Element rounding grid (used by the quantizer): a magnitude with float exponent e is rounded to
    a multiple of 2^(max(e, grid_emin) - mantissa bits at e); ``tapered`` marks HiF8, whose mantissa
    width depends on the exponent.
    """

    name: str
    bits: int
    ebits: int
    mbits: int
    bias: int
    emax: int
    emin: int                     # exponent of min_normal
    max_normal: float
    min_normal: float
    min_subnormal: float
    has_inf: bool
    has_nan: bool
    inf_encoding: Optional[str]
    nan_encoding: Optional[str]
    signed_zero: bool = True
    scaling: str = SCALING_NONE
    block_size: Optional[int] = None
    scale_format: Optional[str] = None
    element: Optional[str] = None          # element format name for scaled formats
    tapered: bool = False                  # HiF8: mantissa bits depend on |exponent|
    grid_emin: Optional[int] = None        # smallest exponent of the rounding grid (subnormals)
    default_rounding: str = "nearest_even"
    description: str = ""
    torch_dtype: Optional[str] = None      # the torch dtype this format is ("bfloat16", ...)
    survey: bool = False                   # in the default surveys (what-if plots, analyze-tensor)

    @property
    def is_block(self) -> bool:
        """Scaled per block (MX, NVFP4): the rows of block-scaled families give a block size."""
        return self.block_size is not None

    @property
    def is_identity(self) -> bool:
        return self.scaling == SCALING_IDENTITY

    @property
    def overflow_value(self) -> str:
        """What a finite value beyond max_normal becomes when saturate=False."""
        if self.has_inf:
            return "inf"
        if self.has_nan:
            return "nan"
        return "max"  # no special encodings: the format can only clamp

    def value_set(self) -> list[float]:
        """All finite values of the element format, sorted (8 bits or fewer only)."""
        if self.bits > 8:
            raise ValueError(f"value_set: {self.name} has {self.bits} bits; only formats of 8 bits "
                             "or fewer are enumerated")
        from .values import enumerate_values
        return enumerate_values(self)

    def summary(self) -> dict:
        keys = ("name", "bits", "ebits", "mbits", "bias", "emax", "emin", "max_normal",
                "min_normal", "min_subnormal", "has_inf", "has_nan", "inf_encoding",
                "nan_encoding", "scaling", "block_size", "scale_format", "element",
                "default_rounding")
        return {k: getattr(self, k) for k in keys}


def _minifloat(name, ebits, mbits, *, ieee_like, nan_all_ones_mantissa=False, **kw) -> FormatSpec:
    """Build an element spec from exponent/mantissa bits.

    ieee_like: top exponent code reserved for Inf/NaN (E5M2, FP16, BF16). Otherwise the top code
    holds normal values; with nan_all_ones_mantissa (E4M3 'fn') only S.1111.111 is NaN.
    """
    bias = (1 << (ebits - 1)) - 1
    emin = 1 - bias
    if ieee_like:
        emax = (1 << ebits) - 2 - bias
        max_normal = (2 - 2.0 ** -mbits) * 2.0 ** emax
        has_inf, has_nan = True, True
        inf_enc = f"S.{'1' * ebits}.{'0' * mbits}"
        nan_enc = f"S.{'1' * ebits}.<nonzero>"
    else:
        emax = (1 << ebits) - 1 - bias
        top = (2 - 2.0 ** -mbits) if not nan_all_ones_mantissa else (2 - 2.0 ** (1 - mbits))
        max_normal = top * 2.0 ** emax
        has_inf, has_nan = False, nan_all_ones_mantissa
        inf_enc = None
        nan_enc = f"S.{'1' * ebits}.{'1' * mbits}" if nan_all_ones_mantissa else None
    return FormatSpec(name=name, bits=1 + ebits + mbits, ebits=ebits, mbits=mbits, bias=bias,
                      emax=emax, emin=emin, max_normal=max_normal, min_normal=2.0 ** emin,
                      min_subnormal=2.0 ** (emin - mbits), has_inf=has_inf, has_nan=has_nan,
                      inf_encoding=inf_enc, nan_encoding=nan_enc, grid_emin=emin, **kw)


_E4M3 = _minifloat("fp8_e4m3", 4, 3, ieee_like=False, nan_all_ones_mantissa=True, survey=True,
                   description="OCP FP8 E4M3 (ml_dtypes float8_e4m3fn): no Inf, NaN S.1111.111")
_E5M2 = _minifloat("fp8_e5m2", 5, 2, ieee_like=True, survey=True,
                   description="OCP FP8 E5M2 (ml_dtypes float8_e5m2): IEEE-like Inf/NaN")
_E3M2 = _minifloat("fp6_e3m2", 3, 2, ieee_like=False,
                   description="OCP MX FP6 E3M2 (ml_dtypes float6_e3m2fn): no Inf, no NaN")
_E2M3 = _minifloat("fp6_e2m3", 2, 3, ieee_like=False,
                   description="OCP MX FP6 E2M3 (ml_dtypes float6_e2m3fn): no Inf, no NaN")
_E2M1 = _minifloat("fp4_e2m1", 2, 1, ieee_like=False,
                   description="OCP MX FP4 E2M1 (ml_dtypes float4_e2m1fn): no Inf, no NaN")
_BF16 = _minifloat("bf16", 8, 7, ieee_like=True, description="bfloat16 cast",
                   torch_dtype="bfloat16", survey=True)
_FP16 = _minifloat("fp16", 5, 10, ieee_like=True, description="IEEE float16 cast",
                   torch_dtype="float16", survey=True)

# MX INT8 element: two's complement with implicit scale 2^-6, used symmetrically (+-127/64).
_INT8 = FormatSpec(
    name="int8", bits=8, ebits=0, mbits=6, bias=0, emax=0, emin=0, max_normal=127 / 64,
    min_normal=2.0 ** -6, min_subnormal=2.0 ** -6, has_inf=False, has_nan=False,
    inf_encoding=None, nan_encoding=None, grid_emin=0,
    description="MX INT8 element: fixed point, step 2^-6, symmetric range +-127/64 (no -2)")

_HIF8 = FormatSpec(
    name="hifp8", bits=8, ebits=5, mbits=3, bias=0, emax=15, emin=-15, max_normal=2.0 ** 15,
    min_normal=2.0 ** -15, min_subnormal=2.0 ** -22, has_inf=True, has_nan=True,
    inf_encoding="0x6F / 0xEF", nan_encoding="0x80", signed_zero=False, tapered=True,
    grid_emin=-22, default_rounding="nearest_away", survey=True,
    description="HiFloat8 (arXiv 2409.16626): dot-coded sign-magnitude exponent, tapered "
                "mantissa (3/2/1 bits), denormals 2^-22..2^-16; ebits/mbits give the widest "
                "exponent field (D=4 plus sign) and mantissa (3)")

_FP32 = FormatSpec(
    name="fp32", bits=32, ebits=8, mbits=23, bias=127, emax=127, emin=-126,
    max_normal=float((2 - 2.0 ** -23) * 2.0 ** 127), min_normal=2.0 ** -126,
    min_subnormal=2.0 ** -149, has_inf=True, has_nan=True, inf_encoding="S.11111111.0...0",
    nan_encoding="S.11111111.<nonzero>", grid_emin=-126, scaling=SCALING_IDENTITY,
    torch_dtype="float32",
    description="no quantization (the input is returned as a copy)")


def _scaled(name, element: FormatSpec, scaling, block_size, scale_format, description,
            survey=False):
    from dataclasses import replace
    return replace(element, name=name, scaling=scaling, block_size=block_size,
                   scale_format=scale_format, element=element.name, description=description,
                   survey=survey)


_ELEMENTS = (_E4M3, _E5M2, _E3M2, _E2M3, _E2M1, _INT8)
_MX = (
    _scaled("mxfp8", _E4M3, SCALING_MX, 32, "e8m0", "OCP MXFP8: E4M3 elements, E8M0 scale / 32", True),
    _scaled("mxfp8_e5m2", _E5M2, SCALING_MX, 32, "e8m0", "OCP MXFP8: E5M2 elements, E8M0 / 32"),
    _scaled("mxfp6_e3m2", _E3M2, SCALING_MX, 32, "e8m0", "OCP MXFP6: E3M2 elements, E8M0 / 32", True),
    _scaled("mxfp6_e2m3", _E2M3, SCALING_MX, 32, "e8m0", "OCP MXFP6: E2M3 elements, E8M0 / 32"),
    _scaled("mxfp4", _E2M1, SCALING_MX, 32, "e8m0", "OCP MXFP4: E2M1 elements, E8M0 / 32", True),
    _scaled("mxint8", _INT8, SCALING_MX, 32, "e8m0", "OCP MXINT8: INT8 elements, E8M0 / 32"),
)
_OTHER = (
    _scaled("nvfp4", _E2M1, SCALING_NVFP4, 16, "e4m3+fp32",
            "NVIDIA NVFP4: E2M1 elements, E4M3 scale / 16, FP32 per-tensor scale", True),
    _HIF8,
    _scaled("fp8_e4m3_tensor", _E4M3, SCALING_TENSOR, None, "fp32",
            "E4M3 with an FP32 per-tensor amax scale (Transformer Engine current scaling)"),
    _scaled("fp8_e5m2_tensor", _E5M2, SCALING_TENSOR, None, "fp32",
            "E5M2 with an FP32 per-tensor amax scale (Transformer Engine current scaling)"),
    _BF16,
    _FP16,
    _FP32,
)

FORMATS: dict[str, FormatSpec] = {s.name: s for s in _ELEMENTS + _MX + _OTHER}

#: the formats a survey tries by default (analyze-tensor, the report's what-if errors)
SURVEY_FORMATS: tuple[str, ...] = tuple(n for n, s in FORMATS.items() if s.survey)
#: capture's default what-if set (quant.whatif): the block formats a run might switch to, an
#: element cast without scaling (hifp8) and a per-tensor scaled FP8
WHATIF_FORMATS: tuple[str, ...] = ("mxfp8", "mxfp4", "nvfp4", "hifp8", "fp8_e4m3_tensor")
#: quant-type names with an underscore, longest first (file-name parsing of old layouts)
UNDERSCORED_NAMES: tuple[str, ...] = tuple(sorted((n for n in FORMATS if "_" in n), key=len,
                                                  reverse=True))
#: torch dtype name -> the format that is that dtype (derived from the table)
FORMAT_OF_DTYPE: dict[str, str] = {s.torch_dtype: s.name for s in FORMATS.values() if s.torch_dtype}
#: element-format name -> its MX format (derived: mxfp8 is the MX format of fp8_e4m3, ...)
MX_OF_ELEMENT: dict[str, str] = {s.element: s.name for s in FORMATS.values()
                                 if s.scaling == SCALING_MX and s.element}


def format_for_dtype(dtype) -> Optional[str]:
    """The format name of a torch dtype (torch.bfloat16 -> 'bf16'), or None."""
    return FORMAT_OF_DTYPE.get(str(dtype).replace("torch.", ""))


def element_formats() -> tuple[str, ...]:
    """The unscaled element formats that have an MX format (the sweep's --elem-format)."""
    return tuple(MX_OF_ELEMENT)


# E8M0 shared-scale range (codes 0x00..0xFE = 2^-127..2^127; 0xFF = NaN).
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127


def get_format(name) -> FormatSpec:
    """Return the spec for a format name (or pass a FormatSpec through).

    Raises ValueError naming the valid formats for an unknown name.
    """
    if isinstance(name, FormatSpec):
        return name
    if isinstance(name, str):
        key = name.strip().lower()
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(f"unknown quantization format {name!r}; valid formats: "
                     f"{', '.join(FORMATS)}")


HIF8_ROUNDING_MODES = ROUNDING_MODES + ("hybrid",)
RANDOM_ROUNDING_MODES = ("stochastic", "hybrid")


def check_rounding(rounding: str, spec: Optional[FormatSpec] = None) -> str:
    """Validate a rounding name; 'hybrid' (HiF8's ties-away / stochastic mix) needs hifp8."""
    valid = HIF8_ROUNDING_MODES if spec is not None and spec.tapered else ROUNDING_MODES
    if rounding not in valid:
        extra = " ('hybrid' is for hifp8 only)" if rounding == "hybrid" else ""
        raise ValueError(f"unknown rounding mode {rounding!r}{extra}; valid modes: "
                         f"{', '.join(valid)}")
    return rounding


def check_scale_mode(scale_mode: str) -> str:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown MX scale mode {scale_mode!r}; valid modes: "
                         f"{', '.join(SCALE_MODES)}")
    return scale_mode
