"""The project's words, each defined once: format names and the one check of a name a user
wrote, high precision, the environment variables, the low-precision dtypes, the GEMM and
operand names and the severity levels.

Why here: every package but ``lowp_common`` may import ``quant``, and a format name is a row of
``quant.formats.FORMATS``, so the one check of it sits beside that table; ``lowp_common`` needs
none of these words. Standard library and ``quant.formats`` only (no torch): the TE factory, the
diagnosis and the checkers load it without torch. ``tests/test_one_definition.py`` fails when a
second spelling of any of these lists appears in the library.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Iterable, Optional

from .formats import FORMATS

# -- high precision -----------------------------------------------------------------------------
#: the name meaning "leave the tensor in high precision" (precision plans, TE roles, capture
#: variants)
HIGH_PRECISION = "hp"
#: every name a user may write for it (lower case; a float32 cast changes no value we quantize)
HIGH_PRECISION_NAMES = (HIGH_PRECISION, "fp32", "none")


def is_high_precision(name: Optional[str]) -> bool:
    """No quantization: unset, empty, or any spelling of high precision (any case)."""
    return name is None or str(name).strip().lower() in ("", *HIGH_PRECISION_NAMES)


class FormatNameError(ValueError):
    """A format name is unknown; the message names where it was read and the valid names."""


def check_format_name(name: object, where: str, known: Optional[Iterable[str]] = None, *,
                      high_precision: bool = True) -> str:
    """THE check of a format (or recipe) name a user wrote: stripped and lower-cased; any
    high-precision spelling is :data:`HIGH_PRECISION` (unless ``high_precision`` is False: a
    list of formats to measure, where "fp32" is the format); else one of ``known`` (default:
    the formats; callers that take recipes pass ``quant.recipes.RECIPES``). ``where`` names the
    setting (an environment variable, a plan's rule) in the one-line error."""
    valid = tuple(FORMATS if known is None else known)
    key = name.strip().lower() if isinstance(name, str) else None
    if high_precision and key in HIGH_PRECISION_NAMES:
        return HIGH_PRECISION
    if key not in valid:
        hp = f", or {' / '.join(HIGH_PRECISION_NAMES)} (no quantization)" if high_precision else ""
        listed = ", ".join(n for n in valid if not (high_precision and n in HIGH_PRECISION_NAMES))
        raise FormatNameError(f"{where}={name!r} is not a known format; valid: {listed}{hp}")
    return key


# -- environment variables ----------------------------------------------------------------------
ENV_ENABLED = "TENSOR_SAVE_ENABLED"
ENV_DIR = "TENSOR_SAVE_DIR"
ENV_ITERATION = "TENSOR_SAVER_ITERATION"
ENV_QUANT = "CUSTOM_QUANT_TYPE"
ENV_PLAN = "CUSTOM_QUANT_PLAN"              # a precision plan file (quant.precision_plan)
ENV_CONFIG = "TENSOR_SAVE_CONFIG"
ENV_WHATIF = "TENSOR_SAVE_WHATIF_FORMATS"   # comma-separated what-if formats; "none": off
ENV_TENSORBOARD = "TENSOR_SAVE_TENSORBOARD_DIR"   # what-if numerics as TensorBoard events here
ENV_MODE = "TENSOR_SAVE_MODE"               # capture (default) | recorder (the flight recorder)
ENV_GUARD = "TENSOR_SAVE_GUARD"             # on: the auto-guard (and the recorder with it)
ENV_COMPILE = "QUANT_COMPILE"               # torch.compile of the quantizers: auto | 0 | 1 (quant.accel)
ENV_ANALYZE = "QUANT_ANALYZE"               # quant.quantize analyses by default (quant.fakequant)
#: the words an on / off variable or setting takes (any case)
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# -- dtypes, GEMMs, operands --------------------------------------------------------------------
#: torch dtype names of the low-precision floating types training runs in (the audit and the
#: static checker judge these)
FLOAT16, BFLOAT16 = LOW_PRECISION_DTYPES = ("float16", "bfloat16")
#: the GEMMs of a linear layer, in the order they run (Transformer Engine's names; the plan of
#: their operands and axes, and attention's qk / pv, is quant.gemm_plan's)
FPROP, DGRAD, WGRAD = LINEAR_GEMMS = ("fprop", "dgrad", "wgrad")
#: the operands of a linear layer's GEMMs (TE's QuantizerRole.tensor_type)
LINEAR_OPERANDS = ("input", "weight", "grad_output")


# -- severity -----------------------------------------------------------------------------------
class Severity(IntEnum):
    """How bad a finding or a ratio is, mildest first: the one ordered scale of quant's ratio
    severity (none / medium / high), the diagnosis, the static checker, the run-time audit and
    the tensor verdicts (LOW / MEDIUM / HIGH). Reports print :attr:`label`, quant's ratio
    severity its :attr:`word`."""

    NONE = 0
    LOW = 1
    MEDIUM = 2
    HIGH = 3

    @property
    def label(self) -> str:
        """As reports and JSON print it: "HIGH"."""
        return self.name

    @property
    def word(self) -> str:
        """As quant's ratio severity spells it: "high"."""
        return self.name.lower()

    @classmethod
    def of(cls, text: str) -> "Severity":
        """The level a label or word names ("HIGH", "high"); KeyError otherwise."""
        return cls[text.upper()]

    @classmethod
    def parse(cls, text: str) -> "Severity":
        """A finding level from a command line (low / medium / high); ValueError otherwise."""
        level = cls.__members__.get(str(text).upper())
        if level is None or level not in FINDING_LEVELS:
            raise ValueError(f"unknown severity {text!r}; use low, medium or high")
        return level


#: the levels a finding can have (a finding is at least LOW; NONE is a ratio with nothing to say)
FINDING_LEVELS = (Severity.LOW, Severity.MEDIUM, Severity.HIGH)
