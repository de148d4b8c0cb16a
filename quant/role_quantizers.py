"""The quantizers a recipe's factory returns, one per GEMM operand role: Transformer Engine's
scalings (current, delayed, MXFP8, FP8 blocks, NVFP4) and a plain format (the trivial recipes).

Why one class per scaling, each holding a :class:`quant.quantizer.Quantizer`: as in TE, where a
recipe is ``factory(role) -> quantizer`` and each scaling is its own quantizer class, the scaling
is the class (no kind string dispatched through a table) and the element cast is our one
Quantizer (its format, rounding and saturation resolved once), which the families' one cast
(``quant.scales.cast_scaled``) takes whole. TE's kernels make choices beyond the format
definitions (the E8M0 exponent of ``amax * fl(1/448)`` rounded up, a global NVFP4 encode scale
whose block scales may underflow to 0, multiplication by a rounded reciprocal, power-of-two
masks of FP8 block scales): each is a scale rule of the family it varies
(``TensorFamily.te_scale`` / ``delayed_scale`` / ``block_scales``, ``MXFamily.te_scales``,
``NVFP4Family.te_scales``). This module adds what is TE's alone: the NaN-ignoring amax and the
16-point random Hadamard transform. Facts were read from TE 2.20 (``common/recipe``,
``common/cast/mxfp8``, ``common/cast/nvfp4``, ``pytorch/custom_recipes/reference_nvfp4.py``);
docs/quant.md lists them.

Layout: :meth:`RoleQuantizer.matrix` takes float32 ``[rows, k]`` (the GEMM reduces over ``k``,
the last axis), so 1 x n blocks run along it and n x n tiles are square; amax reductions ignore
NaN (CUDA ``fmaxf``) and keep Inf. Numerics only: torch and quant.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from . import gemm_plan
from .family_mx import MX
from .family_nvfp4 import NVFP4
from .family_tensor import TENSOR
from .formats import FORMATS, MX_OF_ELEMENT, RANDOM_ROUNDING_MODES
from .layout import noise
from .nvfp4_limits import SCALE_FORMAT
from .quantizer import Quantizer
from .scales import cast_scaled

#: TE's Hadamard sign vector (``get_wgrad_sign_vector`` in custom_recipes/reference_nvfp4.py)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
RHT_SIZE = 16


def amax_ignoring_nan(x: torch.Tensor, dims=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| as CUDA's fmaxf reduction forms it: NaN ignored, Inf kept (0 for all-NaN)."""
    a = x.abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if dims is None:
        return a.amax() if a.numel() else torch.zeros((), dtype=a.dtype)
    return a.amax(dim=dims, keepdim=keepdim)


def hadamard16(device=None) -> torch.Tensor:
    """TE's transform matrix diag(signs) @ H16 / 4 (Sylvester H16, float32; exact entries +-1/4):
    rows of 16 along the reduction axis are multiplied by it (``x @ M``)."""
    h = torch.ones((1, 1), dtype=torch.float32, device=device)
    while h.shape[0] < RHT_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.tensor(RHT_SIGNS, dtype=torch.float32, device=device)[:, None] * h * 0.25


def rht(x: torch.Tensor) -> torch.Tensor:
    """The random Hadamard transform of float32 ``x`` [rows, k] along k in chunks of 16, summed in
    float32 and rounded to bfloat16 as TE's fused kernel does before its amax and cast."""
    rows, k = x.shape
    y = x.reshape(rows, k // RHT_SIZE, RHT_SIZE) @ hadamard16(x.device)
    return y.to(torch.bfloat16).to(torch.float32).reshape(rows, k)


def rht_inverse(y: torch.Tensor) -> torch.Tensor:
    """Back to the original domain (the matrix is orthogonal: its transpose inverts it)."""
    rows, k = y.shape
    return (y.reshape(rows, k // RHT_SIZE, RHT_SIZE) @ hadamard16(y.device).t()).reshape(rows, k)


@dataclass
class OperandContext:
    """One call's facts: the recipe, the operand role, the caller's dtype, random stream and
    delayed-scaling state (``quant.recipes.DelayedScalingState``) and the key of the tensor in
    it."""

    recipe: str
    tensor: str
    gemm: str
    dtype: torch.dtype
    gen: Optional[torch.Generator] = None
    state: Any = None
    key: object = None


def _tiles_pad(m: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    rp, kp = (-m.shape[0]) % tile[0], (-m.shape[1]) % tile[1]
    return torch.nn.functional.pad(m, (0, kp, 0, rp)) if rp or kp else m


@dataclass(frozen=True)
class RoleQuantizer:
    """How one GEMM operand is quantized: ``element`` (the element cast: format, rounding,
    saturation) and the scaling this class implements. ``tile`` is (rows, cols) in the operand's
    GEMM layout [rows, k]: (1, n) blocks run along k; (n, n) tiles are the same numbers for the
    operand and its transpose. ``multiple``: the reduction axis must be a multiple (else
    refused)."""

    element: Quantizer
    tile: Optional[tuple[int, int]] = None
    pow2_scale: bool = False
    rht: bool = False
    multiple: Optional[int] = None
    #: the name capture metadata records (``summary()["kind"]``)
    kind: ClassVar[str] = ""
    #: whether the caller must pass a DelayedScalingState (the scale comes from earlier steps)
    stateful: ClassVar[bool] = False

    @property
    def random(self) -> bool:
        """Whether the element rounding draws from the caller's generator."""
        return self.element.rounding in RANDOM_ROUNDING_MODES

    def summary(self) -> dict:
        """JSON-friendly facts (capture metadata)."""
        return {"kind": self.kind, "element": self.element.spec.name,
                "tile": list(self.tile) if self.tile else None, "pow2_scale": self.pow2_scale,
                "rounding": self.element.rounding, "rht": self.rht}

    def nearest_format(self) -> str:
        """The format of quant.FORMATS nearest to this quantizer (advisory analyses)."""
        return self.element.spec.name + "_tensor"

    @property
    def analysis_format(self) -> Optional[str]:
        """The format whose pre-quantization analysis stands in for this one (None: identity)."""
        name = self.nearest_format()
        return None if FORMATS[name].is_identity else name

    def quantize(self, x: torch.Tensor, axis: int, ctx: OperandContext) -> torch.Tensor:
        """``x`` (as the layer holds it) quantized along ``axis``, the axis its GEMM reduces."""
        if x.numel() == 0:
            return x.detach().clone()
        x2 = x.detach().reshape(-1, x.shape[-1]) if x.dim() != 2 else x.detach()
        m = (x2.t() if axis == 0 else x2).to(torch.float32)
        if self.multiple and m.shape[1] % self.multiple:
            what = gemm_plan.plan(ctx.gemm, ctx.tensor).reduces_over
            raise ValueError(f"recipe {ctx.recipe}: {ctx.tensor} of the {ctx.gemm} GEMM has "
                             f"{m.shape[1]} {what} (its reduction axis); {ctx.recipe} needs a "
                             f"multiple of {self.multiple} there")
        with torch.no_grad():
            y = self.matrix(m.contiguous(), ctx)
        y = y.t() if axis == 0 else y
        return y.reshape(x.shape).to(x.dtype).contiguous()

    def matrix(self, m: torch.Tensor, ctx: OperandContext) -> torch.Tensor:
        """The quantized values of float32 ``m`` [rows, k]."""
        raise NotImplementedError

    def _noise(self, m: torch.Tensor, ctx: OperandContext) -> Optional[torch.Tensor]:
        return noise(m.shape, m.device, ctx.gen, self.element.rounding)


@dataclass(frozen=True)
class FormatRole(RoleQuantizer):
    """One of our formats through quant.quantize (the trivial recipes)."""

    kind: ClassVar[str] = "format"

    def summary(self) -> dict:
        # recorded as "nearest_even" since trivial recipes were first written to metadata (the
        # format's own rounding is what runs: the element's); kept so captures stay comparable
        return {**super().summary(), "rounding": "nearest_even"}

    def nearest_format(self) -> str:
        return self.element.spec.name

    def quantize(self, x: torch.Tensor, axis: int, ctx: OperandContext) -> torch.Tensor:
        from .fakequant import quantize

        return quantize(x, self.element.along(axis), generator=ctx.gen)


@dataclass(frozen=True)
class CurrentScaling(RoleQuantizer):
    """FP8, one float32 scale from this tensor's amax (TE Float8CurrentScaling)."""

    kind: ClassVar[str] = "tensor_current"

    def matrix(self, m, ctx):
        scale = TENSOR.te_scale(amax_ignoring_nan(m), self.element.params.max_normal,
                                self.pow2_scale)
        return cast_scaled(m, TENSOR.te_scales(scale), self.element, self._noise(m, ctx))


@dataclass(frozen=True)
class DelayedScaling(RoleQuantizer):
    """FP8, one float32 scale from an amax history kept by the caller (TE DelayedScaling)."""

    kind: ClassVar[str] = "tensor_delayed"
    stateful: ClassVar[bool] = True

    def matrix(self, m, ctx):
        if ctx.state is None:
            raise ValueError(f"recipe {ctx.recipe}: delayed scaling keeps an amax history; pass "
                             "state=quant.recipes.DelayedScalingState() (owned by the caller)")
        key = (ctx.key, ctx.tensor)
        scale = ctx.state.scale(key).to(m.device)
        y = cast_scaled(m, TENSOR.te_scales(scale), self.element, self._noise(m, ctx))
        ctx.state.observe(key, amax_ignoring_nan(m), self.element.params.max_normal)
        return y


@dataclass(frozen=True)
class MXFP8Scaling(RoleQuantizer):
    """E8M0 scale per 1 x 32 block, the exponent rounded up (TE MXFP8BlockScaling)."""

    kind: ClassVar[str] = "mxfp8"

    def nearest_format(self) -> str:
        return MX_OF_ELEMENT[self.element.spec.name]

    def blocks(self, xb: torch.Tensor) -> torch.Tensor:
        """TE MXFP8 of float32 ``xb`` shaped [..., block] (MXFamily.te_scales, then the cast)."""
        s = MX.te_scales(amax_ignoring_nan(xb, -1, keepdim=True), self.element.params.max_normal)
        return cast_scaled(xb, s, self.element)

    def matrix(self, m, ctx):
        rows, k = m.shape
        block = self.tile[1]
        return self.blocks(m.reshape(rows, k // block, block)).reshape(rows, k)


@dataclass(frozen=True)
class FP8BlockScaling(RoleQuantizer):
    """Float32 (power-of-two) scale per 1 x 128 block / 128 x 128 tile (TE Float8BlockScaling);
    partial blocks are zero-padded as TE pads them."""

    kind: ClassVar[str] = "fp8_block"

    def matrix(self, m, ctx):
        r, c = self.tile
        mp = _tiles_pad(m, self.tile)
        rows, k = mp.shape
        tiles = mp.reshape(rows // r, r, k // c, c)
        amax = amax_ignoring_nan(tiles, (1, 3), keepdim=True)
        scale = TENSOR.block_scales(amax, self.element.params.max_normal, self.pow2_scale,
                                    ctx.dtype)
        y = cast_scaled(tiles, TENSOR.te_scales(scale), self.element, self._noise(tiles, ctx))
        return y.reshape(rows, k)[: m.shape[0], : m.shape[1]]


@dataclass(frozen=True)
class NVFP4Scaling(RoleQuantizer):
    """E4M3 scale per 1 x 16 block / 16 x 16 tile and a float32 global scale (TE
    NVFP4BlockScaling), after the random Hadamard transform when ``rht``."""

    kind: ClassVar[str] = "nvfp4"

    def nearest_format(self) -> str:
        return "nvfp4"

    def tiles(self, x: torch.Tensor, amax: torch.Tensor,
              nz: Optional[torch.Tensor] = None) -> torch.Tensor:
        """TE NVFP4 of float32 ``x`` [rows, k] (rows a multiple of tile[0], k of tile[1]) with
        the global amax ``amax`` (of the whole tensor, after any transform)."""
        r, c = self.tile
        rows, k = x.shape
        tiles = x.reshape(rows // r, r, k // c, c)
        s = NVFP4.te_scales(amax_ignoring_nan(tiles, (1, 3), keepdim=True), amax,
                            Quantizer.of(SCALE_FORMAT.name))
        nz = None if nz is None else nz.reshape(tiles.shape)
        return cast_scaled(tiles, s, self.element, nz).reshape(rows, k)

    def matrix(self, m, ctx):
        mp = _tiles_pad(m, self.tile)
        if self.rht:
            mp = rht(mp)
        y = self.tiles(mp, amax_ignoring_nan(mp), self._noise(mp, ctx))
        if self.rht:
            y = rht_inverse(y)
        return y[: m.shape[0], : m.shape[1]]
