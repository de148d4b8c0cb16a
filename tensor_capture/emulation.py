"""CUSTOM_QUANT_TYPE emulation: fake-quantize GEMM operands as the named recipe does.

CUSTOM_QUANT_TYPE names a recipe of ``quant.recipes`` (every format is a trivial recipe: that
format for every operand). Linear operands go through ``quant.recipes.quantize_operand``
(:func:`quantize_operand`), which quantizes each along the axis its GEMM reduces (in-features
for the forward, out-features for dgrad, tokens for wgrad: quant.gemm_plan, the plan
precision-diff uses too). Attention operands (:func:`quantize`, :func:`quantize_ste`) use the
recipe's attention format, or stay in high precision when the recipe has none (TE's recipes do
not quantize attention). Delayed scaling keeps its amax histories in one process-wide
``DelayedScalingState`` keyed by module path, updated when the iteration changes; stochastic
rounding draws from the emulation's own generator (``STOCHASTIC_SEED`` + rank).

``kind`` names the operand ("linear forward input", ...) for the pre-quantization underflow
warning (:mod:`tensor_capture.underflow`), which runs only while ``STATE.warn_underflow``.
"""
from __future__ import annotations

import torch

from quant.vocabulary import is_high_precision

from .state import STATE

#: stochastic rounding's own random stream (seed + global rank), so emulation never draws from
#: torch's default generator: dropout and initialization stay those of the unemulated run
STOCHASTIC_SEED = 0x5EED


class _RunState:
    """This session's delayed-scaling state and generators (a STATE session part)."""
    __slots__ = ("state", "iteration", "generators")

    def __init__(self) -> None:
        self.state = None               # quant.recipes.DelayedScalingState, made on first use
        self.iteration: int | None = None
        self.generators: dict[torch.device, torch.Generator] = {}


def reset() -> None:
    """Forget the delayed-scaling histories and the generators."""
    STATE.forget(_RunState)


def _generator(device: torch.device) -> torch.Generator:
    generators = STATE.session(_RunState).generators
    g = generators.get(device)
    if g is None:
        rank = torch.distributed.get_rank() if (torch.distributed.is_available()
                                                and torch.distributed.is_initialized()) else 0
        g = generators[device] = torch.Generator(device=device)
        g.manual_seed(STOCHASTIC_SEED + rank)
    return g


def _delayed_state(iteration: int | None):
    """The run's delayed-scaling state, its scales updated once per iteration (TE updates them
    after every autocast region: the same when one micro-batch makes a step)."""
    from quant.recipes import DelayedScalingState

    run = STATE.session(_RunState)
    if run.state is None:
        run.state = DelayedScalingState()
    elif iteration != run.iteration:
        run.state.update()
    run.iteration = iteration
    return run.state


def recipe_name(site: str | None, layer: int | None, role: str) -> str | None:
    """The recipe ``role`` (fprop / dgrad / wgrad) of the module at ``site`` computes in: the
    precision plan's rule (CUSTOM_QUANT_PLAN), else CUSTOM_QUANT_TYPE; None: unquantized."""
    name = STATE.quant_type
    if STATE.plan is not None:
        name = STATE.plan.format_for(site, layer, role, default=name)
    return None if is_high_precision(name) else name


def quantize_operand(x: torch.Tensor, tensor: str, gemm: str, *, kind: str | None = None,
                     site: str | None = None, iteration: int | None = None,
                     layer: int | None = None) -> torch.Tensor:
    """Linear GEMM operand ``tensor`` of ``gemm`` (fprop / dgrad / wgrad) as the
    active recipe (or the precision plan's rule for this module and GEMM) quantizes it; same
    shape and dtype."""
    from quant import recipes
    from quant.gemm_plan import gemm_name

    gemm = gemm_name(gemm)      # "forward" is fprop's older name
    name = recipe_name(site, layer, gemm)
    if name is None:
        return x
    recipe = recipes.get_recipe(name)
    role = recipe.quantizer(tensor, gemm)
    state = _delayed_state(iteration) if role.stateful else None
    gen = _generator(x.device) if role.random else None
    q = recipes.quantize_operand(x, recipe, tensor, gemm, generator=gen, state=state, key=site)
    fmt = role.analysis_format
    if STATE.guard is not None and site is not None:
        STATE.guard.observe(site, gemm, tensor, x, q, fmt=fmt,
                            axis=recipes.operand_axis(tensor, gemm), layer=layer)
    if STATE.warn_underflow and kind is not None and fmt is not None:
        from . import underflow

        underflow.check(x, q, fmt, recipes.operand_axis(tensor, gemm), kind, site=site,
                        iteration=iteration)
    return q


def _attention_format(fmt: str | None, site: str | None = None,
                      layer: int | None = None) -> str | None:
    if fmt is not None:
        return fmt
    name = recipe_name(site, layer, "fprop")   # Q·Kᵀ and P·V: the attention's fprop role
    if name is None:
        return None
    from quant import recipes

    return recipes.get_recipe(name).attention_format


def _quantizer(name: str, axis: int):
    """The attention operand's quant.quantizer.Quantizer (built once per format and axis)."""
    from quant.quantizer import Quantizer

    return Quantizer.of(name, axis=axis)


def _emulate(x: torch.Tensor, axis: int, fmt: str | None, cast, *, kind: str | None,
             site: str | None, iteration: int | None, layer: int | None,
             operand: tuple[str, str] | None = None) -> torch.Tensor:
    """``cast`` (quant.quantize or quant.quantize_ste) of x to the attention operand's format,
    with the underflow warning when it is on; x itself when attention is not emulated.
    ``operand``: (GEMM, operand) of quant.gemm_plan, for the auto-guard."""
    name = _attention_format(fmt, site, layer)
    if name is None:
        return x
    q = cast(x, _quantizer(name, axis))
    if STATE.guard is not None and operand is not None and site is not None:
        STATE.guard.observe(site, operand[0], operand[1], x, q, fmt=name, axis=axis, layer=layer)
    if STATE.warn_underflow and kind is not None:
        from . import underflow

        underflow.check(x, q, name, axis, kind, site=site, iteration=iteration)
    return q


def quantize(x: torch.Tensor, axis: int = -1, fmt: str | None = None, *, kind: str | None = None,
             site: str | None = None, iteration: int | None = None,
             layer: int | None = None, operand: tuple[str, str] | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` to ``fmt`` (default: the active CUSTOM_QUANT_TYPE, or the precision
    plan's fprop rule for the attention at ``site``), same shape/dtype."""
    import quant

    return _emulate(x, axis, fmt, quant.quantize, kind=kind, site=site, iteration=iteration,
                    layer=layer, operand=operand)


def quantize_ste(x: torch.Tensor, axis: int = -1, fmt: str | None = None, *,
                 kind: str | None = None, site: str | None = None,
                 iteration: int | None = None, layer: int | None = None,
                 operand: tuple[str, str] | None = None) -> torch.Tensor:
    """As :func:`quantize`, with a straight-through gradient (for autograd-tracked operands)."""
    import quant

    return _emulate(x, axis, fmt, quant.quantize_ste, kind=kind, site=site,
                    iteration=iteration, layer=layer, operand=operand)
