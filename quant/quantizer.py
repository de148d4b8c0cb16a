"""The quantizer: one configuration (format, rounding, scale mode, block, axis, saturation,
backend), validated once, then called with tensors (``Quantizer.of(fmt, ...)(x)``).

Why an object: every consumer (``quant.quantize``, the analysis, the what-if numbers, training
emulation, the GEMM-operand plan, the TE factory's quantizers) used to thread the same seven
options through every scaling family and backend as positional arguments. As in Transformer
Engine (a quantizer configured once, then ``quantize(tensor)``), a :class:`Quantizer` holds
them resolved (the format's default rounding, its block size, the element cast's constants);
a scaling family reads what it needs from it (``family.quantize(x, quantizer, generator)``), so
a new option is one field here, not a parameter in every family.

``generator`` is a call argument, not configuration: it is state that advances with each draw.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional, Union

import torch

from .backends import resolve_backend
from .elemwise import ElemParams
from .families import family_of
from .formats import DEFAULT_SCALE_MODE, FormatSpec, check_rounding, check_scale_mode, get_format
from .scales import ScalingFamily

__all__ = ["OPTIONS", "Quantizer", "SUPPORTED_DTYPES", "check_input"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_input(x, where: str = "quantize") -> None:
    """TypeError naming the supported dtypes unless ``x`` is a tensor the quantizer takes."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{where}: x has dtype {x.dtype}; supported input dtypes are float32, "
                        "bfloat16 and float16 (convert first, e.g. x.float())")


def _check_options(spec: FormatSpec, rounding: Optional[str], scale_mode: str,
                   block_size: Optional[int]) -> tuple[str, int]:
    """Validate options against the format; return (rounding, block size)."""
    rounding = check_rounding(spec.default_rounding if rounding is None else rounding, spec)
    check_scale_mode(scale_mode)
    if scale_mode != DEFAULT_SCALE_MODE and not family_of(spec).has_scale_modes:
        raise ValueError(f"scale_mode={scale_mode!r} only applies to MX formats (mx*); "
                         f"{spec.name} has scaling {spec.scaling!r}")
    if block_size is not None:
        if not spec.is_block:
            raise ValueError(f"block_size only applies to block formats (mx*, nvfp4); "
                             f"{spec.name} is not one")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return rounding, (block_size or spec.block_size or 0)


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")


#: a field's metadata key naming its keyword in quant.quantize / Quantizer.of (default: the
#: field's own name)
KEYWORD = "keyword"


@dataclass(frozen=True)
class Quantizer:
    """A validated fake-quantization configuration; ``quantizer(x, generator=None)`` returns the
    dequantized values of ``x`` (same shape and dtype, new contiguous tensor, no autograd).

    Its init fields after ``spec`` ARE the options (:data:`OPTIONS`: quant.quantize's keywords,
    :meth:`of`'s, the analysis'), each defined here once. Build it with :meth:`of` (built once
    per configuration) or directly: both go through ``__post_init__``, the one validation.
    ``spec`` may be given as a name, ``rounding`` and ``block`` None mean the format's own, and
    they hold the resolved values after construction (``block`` 0 for formats without blocks);
    ``params`` holds the element cast's constants. :meth:`along` gives the same configuration
    on another axis.
    """

    spec: FormatSpec
    rounding: Optional[str] = None
    scale_mode: str = DEFAULT_SCALE_MODE
    block: Optional[int] = dataclasses.field(default=None, metadata={KEYWORD: "block_size"})
    axis: int = -1
    saturate: bool = True
    backend: str = "auto"
    params: ElemParams = dataclasses.field(init=False, repr=False, compare=False)
    #: this configuration on other axes, built on first use (along)
    _axes: dict = dataclasses.field(init=False, repr=False, compare=False, default=None)
    #: :attr:`kernel`, built on first use
    _kernel: Optional["Quantizer"] = dataclasses.field(init=False, repr=False, compare=False,
                                                       default=None)

    def __post_init__(self) -> None:
        spec = get_format(self.spec)
        rounding, block = _check_options(spec, self.rounding, self.scale_mode, self.block)
        _checked_axis(self.axis)
        for name, value in (("spec", spec), ("rounding", rounding), ("block", block),
                            ("params", ElemParams.of(spec)), ("_axes", {})):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, fmt: Union[str, FormatSpec], **options: Any) -> "Quantizer":
        """The quantizer of ``fmt`` with these options (:data:`OPTIONS`; ValueError /
        TypeError naming the valid values). Built once per distinct configuration."""
        values = _option_values(options, "Quantizer.of")
        try:
            return _cached(fmt, *values)
        except TypeError as exc:
            if "unhashable" not in str(exc):
                raise
        return _build(fmt, *values)

    @classmethod
    def resolve(cls, fmt: Union[str, FormatSpec, "Quantizer"], where: str = "quantize",
                **options: Any) -> "Quantizer":
        """``fmt`` itself when it is a Quantizer (then no option may differ from its default:
        its options are its own), else ``Quantizer.of(fmt, **options)``: how the functions
        that take a format name or a quantizer (quant.quantize, the analysis) read their
        arguments."""
        values = _option_values(options, where)
        if not isinstance(fmt, Quantizer):
            return cls.of(fmt, **options)
        passed = [k for k, v in zip(OPTIONS, values) if v != OPTIONS[k]]
        if passed:
            raise ValueError(f"{where}: options come from the Quantizer passed as fmt; build it "
                             f"with them (Quantizer.of(fmt, ...)) instead of passing {passed}")
        return fmt

    @property
    def family(self) -> ScalingFamily:
        """The scaling family that chooses this format's scales (quant.families)."""
        return family_of(self.spec)

    def along(self, axis: int) -> "Quantizer":
        """This configuration with blocks along ``axis`` (built once per axis)."""
        if axis == self.axis:
            return self
        q = self._axes.get(axis)
        if q is None:
            q = self._axes[axis] = dataclasses.replace(self, axis=axis, block=self.block or None)
        return q

    @property
    def kernel(self) -> "Quantizer":
        """This configuration as the torch kernels take it (their one constant, so their cache
        key): axis and backend are the dispatcher's, so every axis and backend of one format
        configuration shares one compiled kernel."""
        if self._kernel is None:
            object.__setattr__(self, "_kernel", Quantizer.of(
                self.spec, rounding=self.rounding, scale_mode=self.scale_mode,
                block_size=self.block or None, saturate=self.saturate))
        return self._kernel

    def __call__(self, x: torch.Tensor,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        check_input(x)
        _check_generator(generator)
        family = self.family
        run = (family.quantize_triton if resolve_backend(self.backend, x) == "triton"
               else family.quantize)
        with torch.no_grad():
            xd = x.detach()
            if xd.numel() == 0:
                return xd.clone()
            # kernels take the input dtype and compute in float32 (the casts fuse when compiled)
            if self.spec.is_block and xd.dim() == 0:
                return run(xd.reshape(1), self.along(0), generator).reshape(()).contiguous()
            if not xd.is_contiguous() and not self.spec.is_block:
                xd = xd.contiguous()
            return run(xd, self, generator).contiguous()


#: the options, keyword -> default, derived from the fields (quant.quantize's keywords)
OPTIONS: dict[str, Any] = {f.metadata.get(KEYWORD, f.name): f.default
                           for f in dataclasses.fields(Quantizer) if f.init and f.name != "spec"}
#: keyword -> field name
_FIELD_OF = {f.metadata.get(KEYWORD, f.name): f.name
             for f in dataclasses.fields(Quantizer) if f.init and f.name != "spec"}


def _option_values(options: dict, where: str) -> tuple:
    """The options in field order, defaults filled in; TypeError naming an unknown one."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{where}: unknown option(s) {', '.join(unknown)}; the options are "
                        f"{', '.join(OPTIONS)}")
    return tuple(options.get(k, d) for k, d in OPTIONS.items())


def _checked_axis(axis) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"axis must be an int, got {axis!r}")
    return axis


def _build(fmt, *values) -> Quantizer:
    return Quantizer(fmt, **{_FIELD_OF[k]: v for k, v in zip(OPTIONS, values)})


#: typed: block_size=True must not reuse block_size=1's quantizer (bool is refused)
_cached = lru_cache(maxsize=1024, typed=True)(_build)
