"""The what-if numbers of several formats of one tensor in one pass (:func:`whatif_onepass`).

Why: capture computes :func:`quant.whatif.whatif` for five formats on every captured tensor. Per
format that is a quantization and an analysis, several hundred small eager torch calls on a tensor
of at most ``whatif_max_elements`` elements, where the calls' overhead, not the arithmetic, is the
cost. Here the formats share one block layout (the axis moved last, zero padded to a multiple of
every block size), the block amax of each block size, the masks of finite / nonzero values and the
reference sums; their element casts run as ONE cast of the stacked scaled values with per-format
constants (quant.elemwise's cast_rows_, built from the same steps as its one-format cast); the sums come back in one host transfer. On the 81 sampled tensors of one step of
bench_capture's model this takes 0.6x the CPU time of the formats one by one
(bench/bench_whatif.py). Above ``ONEPASS_MAX_ELEMENTS`` elements the formats one by one are
faster (memory, not calls, is then the cost), so :func:`quant.whatif.whatif_set` uses them.
Not compiled: torch.compile of the element work (tried through quant.accel, bit-identical) was
slower than this eager pass at capture's sizes (4.8 vs 3.2 ms of CPU per tensor, guards and a
kernel that recomputes the cast per output included) and no faster on 1M elements.

The result is :func:`quant.whatif.whatif` of each format, exactly (tests/test_quant_whatif_onepass.py
compares them on Gaussian, heavy-tailed, all-zero, NaN / Inf, subnormal, odd-shaped and
low-precision tensors): the casts are the same float32 operations element for element (a product
or quotient by a power of two is exact either way), counts are integer sums, the block
statistics reduce the same values in the same order, and the SQNR / relative-error sums run over
the dequantized values restored to the tensor's own order, one contiguous row per format, as
:mod:`quant.metrics` sums them.

Supported: formats with element, per-tensor, MX or NVFP4 scaling whose default rounding is
nearest-even or nearest-away, with an element grid whose powers of two are normal floats (every
8-bit-or-narrower format, and fp16; not bf16 or fp32). :func:`quant.whatif.whatif_set` computes any
other format on its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import torch

from .elemwise import ElemParams, RowParams, cast_rows_, float_exponent, powers_are_normal
from .families import FAMILIES, family_of
from .formats import DEFAULT_SCALE_MODE, FORMATS, SCALING_IDENTITY, FormatSpec
from .metrics import relative_error_of_sums, sqnr_of_sums
from .quantizer import SUPPORTED_DTYPES
from .scales import finite_amax
from .whatif_record import block_dict, element_dict, int_histogram

__all__ = ["ONEPASS_MAX_ELEMENTS", "supports", "whatif_onepass"]

#: above this many elements the formats one by one are faster (the stacked formats no longer
#: stay in cache; bench/bench_whatif.py): the one pass is for capture's sampled tensors
ONEPASS_MAX_ELEMENTS = 1 << 16
#: layout width when no block format is asked for (any width gives the same numbers)
_ELEMENT_WIDTH = 32
#: every family but the identity (fp32: nothing to quantize, its what-if numbers are trivial)
_SCALINGS = tuple(s for s in FAMILIES if s != SCALING_IDENTITY)
_ROUNDINGS = ("nearest_even", "nearest_away")


def supports(spec: FormatSpec) -> bool:
    """Can :func:`whatif_onepass` compute ``spec`` (module docstring)?"""
    return (spec.scaling in _SCALINGS and spec.default_rounding in _ROUNDINGS
            and powers_are_normal(ElemParams.of(spec)))


@dataclass
class _Layout:
    """The tensor in the shared layout: ``xm`` [rows, width], the axis last, zero padded."""

    x32: torch.Tensor          # float32, the caller's shape (at least 1-d)
    axis: int
    n: int                     # axis length
    xm: torch.Tensor
    absm: torch.Tensor         # |xm|
    nonzero: torch.Tensor      # finite and nonzero (the analysis' "nonzero")

    @property
    def rows(self) -> int:
        return self.xm.shape[0]

    @property
    def width(self) -> int:
        return self.xm.shape[1]

    def blocks(self, t: torch.Tensor, block: int) -> torch.Tensor:
        """``t`` [..., rows, width] viewed as [..., rows, width // block, block]."""
        return t.reshape(*t.shape[:-1], self.width // block, block)

    def restore(self, t: torch.Tensor) -> torch.Tensor:
        """[F, rows, width] -> [F, numel] in the caller's element order (padding dropped)."""
        moved = self.x32.movedim(self.axis, -1).shape
        y = t[..., :self.n].reshape(t.shape[0], *moved).movedim(-1, self.axis + 1)
        return y.reshape(t.shape[0], -1)


def _layout(x: torch.Tensor, axis: int, width_multiple: int) -> _Layout:
    x32 = x.detach().float()
    if x32.dim() == 0:
        x32, axis = x32.reshape(1), 0
    axis %= x32.dim()
    n = x32.shape[axis]
    xm = x32.movedim(axis, -1).reshape(-1, n)
    pad = (-n) % width_multiple
    if pad:
        xm = torch.nn.functional.pad(xm, (0, pad))
    absm = xm.abs()
    nonzero = (absm > 0) & (absm < math.inf)        # NaN compares False both ways
    return _Layout(x32, axis, n, xm, absm, nonzero)


class _Plan(NamedTuple):
    """What the core computes, as constants: the block width ``L`` of the layout, the input
    dtype the quantizer rounds its result to, per format (scaling, block or 0), the formats'
    min_normal [F, 1, 1] and their element casts' constants, one row per format."""

    width: int
    dtype: torch.dtype
    formats: tuple
    specs: tuple
    min_normal: torch.Tensor
    rows: RowParams


def _plan(specs: list[FormatSpec], width: int, dtype: torch.dtype,
          device: torch.device) -> _Plan:
    min_normal = torch.tensor([s.min_normal for s in specs], dtype=torch.float32,
                              device=device).reshape(-1, 1, 1)
    rows = RowParams.stack([ElemParams.of(s) for s in specs],
                           [s.default_rounding for s in specs], 3, device)
    return _Plan(width, dtype, tuple((s.scaling, s.block_size or 0) for s in specs),
                 tuple(specs), min_normal, rows)


def _scaled(x2: torch.Tensor, absm: torch.Tensor, plan: _Plan):
    """Every format's scaled values (what its element cast rounds) [F, nL, L], its dequant
    multipliers and its poisoned-block mask, from the families' Scales (quant.families)."""
    n_l, width = x2.shape
    tensor_amax = finite_amax(x2)
    amax_of = {b: absm.reshape(n_l, width // b, b).amax(dim=-1, keepdim=True)
               for b in {f[1] for f in plan.formats if f[1]}}        # NaN propagates
    ones = torch.ones((), dtype=torch.float32, device=x2.device)
    vs, deqs, bads = [], [], []
    for spec, (_, b, *_) in zip(plan.specs, plan.formats):
        family = family_of(spec)
        s = family.scales_from(amax_of.get(b), tensor_amax, spec, DEFAULT_SCALE_MODE)
        v = s.encoded(x2.reshape(n_l, width // b, b) if family.blocked else x2)
        vs.append(v.reshape(n_l, width))
        deqs.append(ones if s.decode is None else s.decode)
        bads.append(s.poisoned)
    return torch.stack(vs), deqs, bads


def _cast(v: torch.Tensor, plan: _Plan):
    """Every format's element cast of its row of ``v`` [F, nL, L] at once (quant.elemwise's
    cast_rows_); returns (cast values, overflow, underflow): overflow = the rounded magnitude
    is beyond max_normal, underflow = |v| below min_normal (the analysis' definitions, before
    zeros and poisoned blocks are dropped)."""
    a = v.abs()
    under = a < plan.min_normal
    r, over = cast_rows_(a, v, plan.rows)
    return r, over, under


def _granule(fmt: tuple, width: int) -> int:
    """Elements per count of a format in the core's output: its block, else the layout width."""
    return fmt[1] or width


def _core(x2: torch.Tensor, plan: _Plan):
    """Everything the numbers need from the elements: per format the squared and the absolute
    errors [F, nL, L] (the error metrics sum them, in the caller's order), and per format its
    overflow, underflow and flush-to-zero counts [3, nL, L // granule] per block (per layout row
    for formats without blocks) by the analysis' definitions: Inf inputs overflow; a block
    holding NaN / Inf is NaN in the output and neither overflows nor underflows; zeros (the
    padding among them) never count."""
    absm = x2.abs()
    v, deqs, bads = _scaled(x2, absm, plan)
    r, over, under = _cast(v, plan)
    n_l, width = x2.shape
    y = torch.empty(r.shape, dtype=r.dtype, device=r.device)   # written per format in place
    ok = torch.ones(over.shape, dtype=torch.bool, device=r.device)
    for i, (deq, bad) in enumerate(zip(deqs, bads)):
        if bad is None:
            torch.mul(r[i], deq, out=y[i])
            continue
        blocks = (deq.shape[0], deq.shape[1], -1)
        yb = y[i].view(blocks)
        torch.mul(r[i].view(blocks), deq, out=yb)
        yb.masked_fill_(bad, math.nan)
        ok[i].view(blocks).copy_(~bad)
    if plan.dtype != torch.float32:        # the quantizer returns the input's dtype
        y = y.to(plan.dtype).float()
    nonzero = (absm > 0) & (absm < math.inf)        # finite and nonzero; NaN compares False
    masks = torch.stack([torch.isinf(x2) | (torch.isfinite(x2) & over & ok),
                         nonzero & under & ok, nonzero & (y == 0)], dim=1)
    counts = []
    for i, fmt in enumerate(plan.formats):
        g = _granule(fmt, width)
        counts.append(masks[i].reshape(3, n_l, width // g, g).sum(-1, dtype=torch.int32))
    diff = x2 - y
    return diff ** 2, diff.abs(), counts


def _onepass(x: torch.Tensor, specs: list[FormatSpec], axis: int) -> dict[str, Any]:
    sizes = [s.block_size for s in specs if s.block_size]
    width = math.lcm(*sizes) if sizes else _ELEMENT_WIDTH
    lay = _layout(x, axis, width)
    plan = _plan(specs, width, x.dtype, x.device)
    sq, ab, counts = _core(lay.xm.reshape(-1, width), plan)
    sq, ab = (t.reshape(len(specs), lay.rows, lay.width) for t in (sq, ab))
    counts = [c.reshape(3, lay.rows, -1) for c in counts]
    totals = torch.stack([c.reshape(3, -1).sum(-1, dtype=torch.int64) for c in counts])
    ref = lay.x32.reshape(-1)
    sq, ab = lay.restore(sq), lay.restore(ab)
    f = len(specs)
    sums = torch.stack([torch.sum(ref * ref), ref.abs().sum()]
                       + [torch.sum(sq[i]) for i in range(f)]
                       + [ab[i].sum() for i in range(f)]).tolist()
    signal, ref_abs, noise, abs_err = sums[0], sums[1], sums[2:2 + f], sums[2 + f:]
    shared: dict[int, tuple] = {}
    out: dict[str, Any] = {}
    for i, (spec, (n_over, n_under, n_flush)) in enumerate(zip(specs, totals.tolist())):
        res = element_dict(lay.axis, sqnr_of_sums(signal, noise[i]),
                           relative_error_of_sums(abs_err[i], ref_abs), overflow=int(n_over),
                           underflow=int(n_under), flushed=int(n_flush),
                           total=lay.x32.numel())
        if spec.block_size:
            res.update(_block_numbers(lay, spec, counts[i], shared))
        out[spec.name] = res
    return out


def _block_numbers(lay: _Layout, spec: FormatSpec, counts: torch.Tensor,
                   shared: dict) -> dict[str, Any]:
    """quant.whatif's block numbers of one block format, over the format's own blocks (the
    amax, live blocks and dynamic-range histogram depend on the block size alone: shared)."""
    b = spec.block_size
    nb = -(-lay.n // b)
    if b not in shared:
        amax = lay.blocks(lay.absm, b)[:, :nb].amax(dim=-1)
        live = torch.isfinite(amax) & (amax > 0)
        mnz = torch.where(lay.blocks(lay.nonzero, b)[:, :nb], lay.blocks(lay.absm, b)[:, :nb],
                          math.inf).amin(dim=-1)
        shared[b] = amax, live, int_histogram(float_exponent(amax[live])
                                              - float_exponent(mnz[live]))
    amax, live, dyn = shared[b]
    family = family_of(spec)
    tensor_amax = finite_amax(lay.xm) if family.uses_tensor_amax else None
    scales = family.scales_from(amax[live], tensor_amax, spec, DEFAULT_SCALE_MODE).stored
    return block_dict(spec, b, lay.n, amax.numel(), live_scales=scales,
                      dynamic_range_hist={"min_bin": dyn["min_bin"], "counts": list(dyn["counts"])},
                      clipped=counts[0][:, :nb], flushed=counts[2][:, :nb])


def whatif_onepass(x: torch.Tensor, formats: Iterable[str], axis: int = -1,
                   max_elements: int = ONEPASS_MAX_ELEMENTS) -> dict[str, Any]:
    """``{format: quant.whatif.whatif(x, format, axis)}`` for the formats of ``formats`` this
    module supports (module docstring), computed together; the others are left out, as is
    everything when ``x`` is not a non-empty tensor of a quantizable dtype or has more than
    ``max_elements`` elements (the caller computes those one by one, errors included)."""
    specs = [FORMATS[f] for f in dict.fromkeys(formats)
             if isinstance(f, str) and f in FORMATS and supports(FORMATS[f])]
    if (not specs or not isinstance(x, torch.Tensor) or x.dtype not in SUPPORTED_DTYPES
            or x.numel() == 0 or x.numel() > max_elements):
        return {}
    with torch.no_grad():
        return _onepass(x, specs, axis)
