"""Recipes: per GEMM operand role, the quantizer a training recipe applies (one table).

Why recipes and not formats: researchers train with Transformer Engine *recipes*
(Megatron-LM's ``--fp8-recipe delayed | tensorwise | blockwise | mxfp8``, ``--fp4-recipe nvfp4``),
which choose per operand of each GEMM the element format, the block or tile shape, how the scale
is rounded, the rounding of elements and transforms. As in TE, a recipe is a factory:
``factory(role) -> quantizer`` for each role ``(tensor, gemm)`` of :data:`ROLES`, the quantizer
one of ``quant.role_quantizers`` (a scaling class holding its element
:class:`quant.quantizer.Quantizer`); ``quantize_operand`` fake-quantizes one operand along the
axis its GEMM reduces (``quant.gemm_plan``). Every format of ``quant.FORMATS`` is also a
(trivial) recipe: the same format for every operand, as ``CUSTOM_QUANT_TYPE`` always emulated
it. Adding a recipe: docs/architecture.md, *A recipe*.

Operand layout (as the linear layer holds it): input ``[tokens, in]`` (or ``[s, b, in]``),
weight ``[out, in]``, grad_output ``[tokens, out]``. fprop reduces over ``in``, dgrad over
``out``, wgrad over tokens. The result has x's shape and dtype, in x's domain (a transform such
as TE's random Hadamard transform is undone after quantization, so a high-precision GEMM of two
results is the quantized GEMM).

Numerics only: torch and quant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import gemm_plan
from .family_tensor import TENSOR
from .formats import FORMATS
from .quantizer import Quantizer
from .role_quantizers import (
    CurrentScaling,
    DelayedScaling,
    FormatRole,
    FP8BlockScaling,
    MXFP8Scaling,
    NVFP4Scaling,
    OperandContext,
    RoleQuantizer,
)

GEMMS = gemm_plan.LINEAR_GEMMS
#: the six operand roles (tensor, gemm), in the order the GEMMs run (from quant.gemm_plan.PLAN)
ROLES: tuple[tuple[str, str], ...] = tuple((p.operand, p.gemm) for p in gemm_plan.PLAN
                                           if p.gemm in GEMMS)
#: a recipe's factory: role (tensor, gemm) -> the quantizer of that operand
Factory = Callable[[tuple[str, str]], RoleQuantizer]


@dataclass(frozen=True)
class Recipe:
    """One recipe: its factory (role -> quantizer), and where it comes from."""

    name: str
    description: str
    factory: Factory
    megatron: Optional[tuple[str, str]] = None   # (flag, value) that selects it in Megatron-LM
    attention_format: Optional[str] = None       # attention Q·Kᵀ / P·V (None: not quantized)

    def quantizer(self, tensor: str, gemm: str) -> RoleQuantizer:
        """The quantizer of operand ``tensor`` of ``gemm`` (ValueError naming the roles)."""
        gemm = gemm_plan.gemm_name(gemm)
        if (tensor, gemm) not in ROLES:
            raise ValueError(f"no GEMM operand {tensor!r} of {gemm!r}; the operands are "
                             + ", ".join(f"{t}/{g}" for t, g in ROLES))
        return self.factory((tensor, gemm))

    def summary(self) -> dict:
        """{"tensor/gemm": quantizer summary} for every role (capture metadata, docs)."""
        return {f"{t}/{g}": self.factory((t, g)).summary() for t, g in ROLES}


def _roles(input_fprop: RoleQuantizer, weight: RoleQuantizer, grad: RoleQuantizer,
           grad_wgrad: Optional[RoleQuantizer] = None,
           input_wgrad: Optional[RoleQuantizer] = None,
           weight_dgrad: Optional[RoleQuantizer] = None) -> Factory:
    """The factory of a table: each operand's quantizer, the same in every GEMM unless given."""
    return {("input", "fprop"): input_fprop, ("weight", "fprop"): weight,
            ("grad_output", "dgrad"): grad, ("weight", "dgrad"): weight_dgrad or weight,
            ("grad_output", "wgrad"): grad_wgrad or grad,
            ("input", "wgrad"): input_wgrad or input_fprop}.__getitem__


_E4M3, _E5M2 = Quantizer.of("fp8_e4m3"), Quantizer.of("fp8_e5m2")
_E2M1, _E2M1_SR = Quantizer.of("fp4_e2m1"), Quantizer.of("fp4_e2m1", rounding="stochastic")
_NV16 = NVFP4Scaling(_E2M1, (1, 16), multiple=16)
_MX32 = MXFP8Scaling(_E4M3, (1, 32), multiple=32)
_BLK = FP8BlockScaling(_E4M3, (1, 128), pow2_scale=True)

_TE_RECIPES = (
    Recipe("te_fp8_delayed",
           "TE DelayedScaling, Megatron's defaults (HYBRID: E4M3 forward, E5M2 gradients; amax "
           "history 1, most_recent, margin 0): the scale comes from earlier steps' amax",
           _roles(DelayedScaling(_E4M3), DelayedScaling(_E4M3), DelayedScaling(_E5M2)),
           ("--fp8-recipe", "delayed")),
    Recipe("te_fp8_tensorwise",
           "TE Float8CurrentScaling (HYBRID: E4M3 forward, E5M2 gradients), one float32 scale "
           "from each tensor's own amax",
           _roles(CurrentScaling(_E4M3), CurrentScaling(_E4M3), CurrentScaling(_E5M2)),
           ("--fp8-recipe", "tensorwise")),
    Recipe("te_fp8_blockwise",
           "TE Float8BlockScaling (E4M3): power-of-two float32 scales per 1x128 block of "
           "activations and gradients, per 128x128 tile of weights",
           _roles(_BLK, FP8BlockScaling(_E4M3, (128, 128), pow2_scale=True), _BLK),
           ("--fp8-recipe", "blockwise")),
    Recipe("te_mxfp8",
           "TE MXFP8BlockScaling (E4M3 everywhere): E8M0 scale per 32 values, the exponent of "
           "amax * (1/448) rounded up",
           _roles(_MX32, _MX32, _MX32), ("--fp8-recipe", "mxfp8")),
    Recipe("te_nvfp4",
           "TE NVFP4BlockScaling: E2M1 with an E4M3 scale per 16 values and a float32 global "
           "scale; weights in 16x16 tiles; gradients rounded stochastically; the wgrad operands "
           "go through the 16-point random Hadamard transform first",
           _roles(_NV16, NVFP4Scaling(_E2M1, (16, 16), multiple=16),
                  NVFP4Scaling(_E2M1_SR, (1, 16), multiple=16),
                  grad_wgrad=NVFP4Scaling(_E2M1_SR, (1, 16), rht=True, multiple=16),
                  input_wgrad=NVFP4Scaling(_E2M1, (1, 16), rht=True, multiple=16)),
           ("--fp4-recipe", "nvfp4")),
)


def _trivial(name: str) -> Recipe:
    role = FormatRole(Quantizer.of(name))
    return Recipe(name, f"the format {name} for every operand ({FORMATS[name].description})",
                  lambda _role: role, attention_format=name)


RECIPES: dict[str, Recipe] = {r.name: r for r in _TE_RECIPES}
RECIPES.update({n: _trivial(n) for n in FORMATS})
#: Megatron-LM flag -> its value -> the recipe that emulates it (derived from the table)
MEGATRON_EMULATION: dict[str, dict[str, str]] = {}
for _r in _TE_RECIPES:
    MEGATRON_EMULATION.setdefault(_r.megatron[0], {})[_r.megatron[1]] = _r.name


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
            self._scale[key] = TENSOR.delayed_scale(h, self.scale(key), self._fp8_max[key],
                                                   self.margin, self.algo)
            rolled = torch.roll(h, -1)          # [i] <- [i + 1], the last <- the current
            rolled[0] = 0.0
            self._history[key] = rolled


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
    A reduction axis that the recipe cannot tile (``RoleQuantizer.multiple``) is refused with
    ValueError naming the dimension and the multiple; partial 2-D tiles and FP8 blocks are
    zero-padded as TE pads them.
    """
    r = get_recipe(recipe)
    gemm = gemm_plan.gemm_name(gemm)
    q = r.quantizer(tensor, gemm)
    axis = operand_axis(tensor, gemm)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize_operand: x must be a floating-point tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    return q.quantize(x, axis, OperandContext(r.name, tensor, gemm, x.dtype, generator, state,
                                              key))
