"""Recipes: per GEMM operand, the quantization a training recipe applies (one table).

Why recipes and not formats: researchers train with Transformer Engine *recipes*
(Megatron-LM's ``--fp8-recipe delayed | tensorwise | blockwise | mxfp8``, ``--fp4-recipe nvfp4``),
which choose per operand of each GEMM the element format, the block or tile shape, how the scale
is rounded, the rounding of elements and transforms. A recipe here is one row of ``RECIPES``:
an :class:`OperandSpec` per operand role; ``quantize_operand`` fake-quantizes one operand along
the axis its GEMM reduces (``quant.gemm_plan``) with TE's arithmetic (``quant.te_arith``). Every
format of ``quant.FORMATS`` is also a (trivial) recipe: the same format for every operand, as
``CUSTOM_QUANT_TYPE`` always emulated it.

Operand layout (as the linear layer holds it): input ``[tokens, in]`` (or ``[s, b, in]``),
weight ``[out, in]``, grad_output ``[tokens, out]``. fprop reduces over ``in``, dgrad over
``out``, wgrad over tokens. The result has x's shape and dtype, in x's domain (a transform such
as TE's random Hadamard transform is undone after quantization, so a high-precision GEMM of two
results is the quantized GEMM).

Numerics only: torch and quant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from . import gemm_plan, te_arith
from .formats import FORMATS, MX_OF_ELEMENT

GEMMS = gemm_plan.LINEAR_GEMMS
#: the six operand roles (tensor, gemm), in the order the GEMMs run (from quant.gemm_plan.PLAN)
ROLES: tuple[tuple[str, str], ...] = tuple((p.operand, p.gemm) for p in gemm_plan.PLAN
                                           if p.gemm in GEMMS)

# OperandSpec.kind values: how the operand is scaled
FORMAT = "format"              # one of our formats through quant.quantize (trivial recipes)
TENSOR_CURRENT = "tensor_current"   # FP8, one float32 scale from this tensor's amax
TENSOR_DELAYED = "tensor_delayed"   # FP8, one float32 scale from an amax history (state)
MXFP8 = "mxfp8"                # E8M0 scale per 1 x 32 block, exponent rounded up
FP8_BLOCK = "fp8_block"        # float32 (power-of-two) scale per 1 x 128 block / 128 x 128 tile
NVFP4 = "nvfp4"                # E4M3 scale per 1 x 16 block / 16 x 16 tile, float32 global scale


@dataclass(frozen=True)
class OperandSpec:
    """How one GEMM operand is quantized. ``tile`` is (rows, cols) in the operand's GEMM layout
    [rows, k] (k = the reduction axis): (1, n) blocks run along k; (n, n) tiles are the same
    numbers for the operand and its transpose."""

    kind: str
    element: str                        # element format (kind FORMAT: our format name)
    tile: Optional[tuple[int, int]] = None
    pow2_scale: bool = False
    rounding: str = "nearest_even"      # nearest_even | stochastic
    rht: bool = False                   # 16-point random Hadamard transform along k first
    multiple: Optional[int] = None      # the reduction axis must be a multiple (else refused)

    def summary(self) -> dict:
        """JSON-friendly facts (capture metadata)."""
        return {"kind": self.kind, "element": self.element,
                "tile": list(self.tile) if self.tile else None, "pow2_scale": self.pow2_scale,
                "rounding": self.rounding, "rht": self.rht}


@dataclass(frozen=True)
class Recipe:
    """One recipe: a spec per operand role, and where it comes from."""

    name: str
    description: str
    specs: Mapping[tuple[str, str], OperandSpec]
    megatron: Optional[tuple[str, str]] = None   # (flag, value) that selects it in Megatron-LM
    attention_format: Optional[str] = None       # attention Q·Kᵀ / P·V (None: not quantized)

    def spec(self, tensor: str, gemm: str) -> OperandSpec:
        return self.specs[(tensor, gemm)]

    def summary(self) -> dict:
        """{"tensor/gemm": spec summary} for every role (capture metadata, docs)."""
        return {f"{t}/{g}": self.specs[(t, g)].summary() for t, g in ROLES}


def _roles(input_fprop: OperandSpec, weight: OperandSpec, grad: OperandSpec,
           grad_wgrad: Optional[OperandSpec] = None, input_wgrad: Optional[OperandSpec] = None,
           weight_dgrad: Optional[OperandSpec] = None) -> dict:
    return {("input", "fprop"): input_fprop, ("weight", "fprop"): weight,
            ("grad_output", "dgrad"): grad, ("weight", "dgrad"): weight_dgrad or weight,
            ("grad_output", "wgrad"): grad_wgrad or grad,
            ("input", "wgrad"): input_wgrad or input_fprop}


_E4M3, _E5M2 = "fp8_e4m3", "fp8_e5m2"
_NV16 = OperandSpec(NVFP4, "fp4_e2m1", (1, 16), multiple=16)
_MX32 = OperandSpec(MXFP8, _E4M3, (1, 32), multiple=32)
_BLK = OperandSpec(FP8_BLOCK, _E4M3, (1, 128), pow2_scale=True)

_TE_RECIPES = (
    Recipe("te_fp8_delayed",
           "TE DelayedScaling, Megatron's defaults (HYBRID: E4M3 forward, E5M2 gradients; amax "
           "history 1, most_recent, margin 0): the scale comes from earlier steps' amax",
           _roles(OperandSpec(TENSOR_DELAYED, _E4M3), OperandSpec(TENSOR_DELAYED, _E4M3),
                  OperandSpec(TENSOR_DELAYED, _E5M2)), ("--fp8-recipe", "delayed")),
    Recipe("te_fp8_tensorwise",
           "TE Float8CurrentScaling (HYBRID: E4M3 forward, E5M2 gradients), one float32 scale "
           "from each tensor's own amax",
           _roles(OperandSpec(TENSOR_CURRENT, _E4M3), OperandSpec(TENSOR_CURRENT, _E4M3),
                  OperandSpec(TENSOR_CURRENT, _E5M2)), ("--fp8-recipe", "tensorwise")),
    Recipe("te_fp8_blockwise",
           "TE Float8BlockScaling (E4M3): power-of-two float32 scales per 1x128 block of "
           "activations and gradients, per 128x128 tile of weights",
           _roles(_BLK, OperandSpec(FP8_BLOCK, _E4M3, (128, 128), pow2_scale=True), _BLK),
           ("--fp8-recipe", "blockwise")),
    Recipe("te_mxfp8",
           "TE MXFP8BlockScaling (E4M3 everywhere): E8M0 scale per 32 values, the exponent of "
           "amax * (1/448) rounded up",
           _roles(_MX32, _MX32, _MX32), ("--fp8-recipe", "mxfp8")),
    Recipe("te_nvfp4",
           "TE NVFP4BlockScaling: E2M1 with an E4M3 scale per 16 values and a float32 global "
           "scale; weights in 16x16 tiles; gradients rounded stochastically; the wgrad operands "
           "go through the 16-point random Hadamard transform first",
           _roles(_NV16, OperandSpec(NVFP4, "fp4_e2m1", (16, 16), multiple=16),
                  OperandSpec(NVFP4, "fp4_e2m1", (1, 16), rounding="stochastic", multiple=16),
                  grad_wgrad=OperandSpec(NVFP4, "fp4_e2m1", (1, 16), rounding="stochastic",
                                         rht=True, multiple=16),
                  input_wgrad=OperandSpec(NVFP4, "fp4_e2m1", (1, 16), rht=True, multiple=16)),
           ("--fp4-recipe", "nvfp4")),
)


def _trivial(name: str) -> Recipe:
    spec = OperandSpec(FORMAT, name)
    return Recipe(name, f"the format {name} for every operand ({FORMATS[name].description})",
                  {role: spec for role in ROLES}, attention_format=name)


RECIPES: dict[str, Recipe] = {r.name: r for r in _TE_RECIPES}
RECIPES.update({n: _trivial(n) for n in FORMATS})
#: Megatron-LM flag -> its value -> the recipe that emulates it (derived from the table)
MEGATRON_EMULATION: dict[str, dict[str, str]] = {}
for _r in _TE_RECIPES:
    MEGATRON_EMULATION.setdefault(_r.megatron[0], {})[_r.megatron[1]] = _r.name


#: kind -> the format of quant.FORMATS nearest to it (advisory analyses: underflow warnings)
_ANALYSIS: dict[str, Callable[[OperandSpec], str]] = {
    FORMAT: lambda s: s.element, NVFP4: lambda s: "nvfp4",
    MXFP8: lambda s: MX_OF_ELEMENT[s.element], TENSOR_CURRENT: lambda s: s.element + "_tensor",
    TENSOR_DELAYED: lambda s: s.element + "_tensor", FP8_BLOCK: lambda s: s.element + "_tensor"}


def analysis_format(spec: OperandSpec) -> Optional[str]:
    """The format whose pre-quantization analysis stands in for ``spec`` (None: identity)."""
    name = _ANALYSIS[spec.kind](spec)
    return None if FORMATS[name].is_identity else name


def get_recipe(name) -> Recipe:
    """The recipe called ``name`` (a Recipe passes through); ValueError lists the valid names."""
    if isinstance(name, Recipe):
        return name
    if isinstance(name, str) and name.strip().lower() in RECIPES:
        return RECIPES[name.strip().lower()]
    raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(RECIPES)}")


# ---- delayed scaling state --------------------------------------------------------------------
@dataclass
class DelayedScalingState:
    """The amax histories and scales of TE's delayed scaling, owned by the caller.

    ``quantize_operand`` reads the scale of its key and records the tensor's amax (the running
    max within a step, as TE's amax buffer); :meth:`update` rolls every history and derives new
    scales (TE's ``amax_and_scale_update``; call it once per step). The first step uses scale 1,
    as TE does.
    """

    history_len: int = 1
    algo: str = "most_recent"          # most_recent | max
    margin: int = 0
    _history: dict = field(default_factory=dict)
    _scale: dict = field(default_factory=dict)
    _fp8_max: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.algo not in ("most_recent", "max"):
            raise ValueError(f"DelayedScalingState: algo {self.algo!r}; use most_recent or max")
        if self.history_len < 1:
            raise ValueError("DelayedScalingState: history_len must be >= 1")

    def scale(self, key) -> torch.Tensor:
        return self._scale.get(key, torch.ones((), dtype=torch.float32))

    def observe(self, key, amax: torch.Tensor, fp8_max: float) -> None:
        """Fold a tensor's amax into the current history slot (on the amax's device: no sync)."""
        h = self._history.get(key)
        if h is None:
            h = self._history[key] = torch.zeros(self.history_len, dtype=torch.float32,
                                                 device=amax.device)
        h[0] = torch.fmax(h[0], amax.to(torch.float32))
        self._fp8_max[key] = fp8_max

    def update(self) -> None:
        for key, h in self._history.items():
            self._scale[key] = te_arith.delayed_scale(h, self.scale(key), self._fp8_max[key],
                                                      self.margin, self.algo)
            rolled = torch.roll(h, -1)          # [i] <- [i + 1], the last <- the current
            rolled[0] = 0.0
            self._history[key] = rolled


# ---- quantizers per kind (the table quantize_operand dispatches on) ------------------------------
def _noise(m: torch.Tensor, spec: OperandSpec, generator) -> Optional[torch.Tensor]:
    if spec.rounding != "stochastic":
        return None
    return torch.rand(m.shape, generator=generator, device=m.device, dtype=torch.float32)


def _tiles_pad(m: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    rp, kp = (-m.shape[0]) % tile[0], (-m.shape[1]) % tile[1]
    return torch.nn.functional.pad(m, (0, kp, 0, rp)) if rp or kp else m


def _q_current(m, spec, ctx):
    scale = te_arith.scale_from_amax(te_arith.amax_ignoring_nan(m),
                                     te_arith.ELEMENTS[spec.element].max_normal, spec.pow2_scale)
    return te_arith.scaled_cast(m, scale, spec.element, spec.rounding, _noise(m, spec, ctx.gen))


def _q_delayed(m, spec, ctx):
    if ctx.state is None:
        raise ValueError(f"recipe {ctx.recipe}: delayed scaling keeps an amax history; pass "
                         "state=quant.recipes.DelayedScalingState() (owned by the caller)")
    key = (ctx.key, ctx.tensor)
    scale = ctx.state.scale(key).to(m.device)
    y = te_arith.scaled_cast(m, scale, spec.element, spec.rounding, _noise(m, spec, ctx.gen))
    ctx.state.observe(key, te_arith.amax_ignoring_nan(m),
                      te_arith.ELEMENTS[spec.element].max_normal)
    return y


def _q_mxfp8(m, spec, ctx):
    rows, k = m.shape
    return te_arith.mxfp8_blocks(m.reshape(rows, k // 32, 32), spec.element).reshape(rows, k)


def _q_fp8_block(m, spec, ctx):
    r, c = spec.tile
    mp = _tiles_pad(m, spec.tile)
    rows, k = mp.shape
    tiles = mp.reshape(rows // r, r, k // c, c)
    amax = te_arith.amax_ignoring_nan(tiles, (1, 3), keepdim=True)
    scale = te_arith.fp8_block_scales(amax, spec.element, spec.pow2_scale, ctx.dtype)
    noise = _noise(tiles, spec, ctx.gen)
    y = te_arith.scaled_cast(tiles, scale, spec.element, spec.rounding, noise)
    return y.reshape(rows, k)[: m.shape[0], : m.shape[1]]


def _q_nvfp4(m, spec, ctx):
    mp = _tiles_pad(m, spec.tile)
    if spec.rht:
        mp = te_arith.rht(mp)
    amax = te_arith.amax_ignoring_nan(mp)
    y = te_arith.nvfp4_tiles(mp, spec.tile, amax, spec.rounding, _noise(mp, spec, ctx.gen))
    if spec.rht:
        y = te_arith.rht_inverse(y)
    return y[: m.shape[0], : m.shape[1]]


@dataclass
class _Ctx:
    recipe: str
    tensor: str
    dtype: torch.dtype
    gen: Optional[torch.Generator]
    state: Optional[DelayedScalingState]
    key: object


_KINDS: dict[str, Callable] = {TENSOR_CURRENT: _q_current, TENSOR_DELAYED: _q_delayed,
                               MXFP8: _q_mxfp8, FP8_BLOCK: _q_fp8_block, NVFP4: _q_nvfp4}


def _role(recipe: Recipe, tensor: str, gemm: str) -> tuple[str, OperandSpec]:
    gemm = gemm_plan.gemm_name(gemm)
    if (tensor, gemm) not in recipe.specs:
        raise ValueError(f"no GEMM operand {tensor!r} of {gemm!r}; the operands are "
                         + ", ".join(f"{t}/{g}" for t, g in ROLES))
    return gemm, recipe.specs[(tensor, gemm)]


def operand_axis(tensor: str, gemm: str) -> int:
    """The axis of the operand (as the layer holds it) that ``gemm`` reduces over."""
    return gemm_plan.axis(gemm, tensor)


def quantize_operand(x: torch.Tensor, recipe, tensor: str, gemm: str, *,
                     generator: Optional[torch.Generator] = None,
                     state: Optional[DelayedScalingState] = None, key: object = None,
                     ) -> torch.Tensor:
    """Fake-quantize GEMM operand ``x`` (``tensor`` of ``gemm``) as ``recipe`` does: same shape
    and dtype, along the axis the GEMM reduces, in x's domain.

    generator: the random stream of stochastic rounding (reproducible results).
    state / key: the caller's :class:`DelayedScalingState` and the key of this tensor in it
    (e.g. the module path) for delayed scaling; nothing else keeps state.
    A reduction axis that the recipe cannot tile (``OperandSpec.multiple``) is refused with
    ValueError naming the dimension and the multiple; partial 2-D tiles and FP8 blocks are
    zero-padded as TE pads them.
    """
    r = get_recipe(recipe)
    gemm, spec = _role(r, tensor, gemm)
    axis = operand_axis(tensor, gemm)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize_operand: x must be a floating-point tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if spec.kind == FORMAT:
        from .fakequant import quantize

        return quantize(x, spec.element, axis=axis, generator=generator)
    if x.numel() == 0:
        return x.detach().clone()
    x2 = x.detach().reshape(-1, x.shape[-1]) if x.dim() != 2 else x.detach()
    m = (x2.t() if axis == 0 else x2).to(torch.float32)
    if spec.multiple and m.shape[1] % spec.multiple:
        what = gemm_plan.plan(gemm, tensor).reduces_over
        raise ValueError(f"recipe {r.name}: {tensor} of the {gemm} GEMM has {m.shape[1]} "
                         f"{what} (its reduction axis); {r.name} needs a multiple of "
                         f"{spec.multiple} there")
    with torch.no_grad():
        y = _KINDS[spec.kind](m.contiguous(), spec,
                              _Ctx(r.name, tensor, x.dtype, generator, state, key))
    y = y.t() if axis == 0 else y
    return y.reshape(x.shape).to(x.dtype).contiguous()


