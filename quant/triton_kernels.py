"""Triton kernels of the fake quantizers: each scaling family's Triton implementation
(``quantize_triton`` of quant/family_*.py launches them), the same bit-space arithmetic as the
element cast of ``elemwise`` and the families' scales, fused into one pass over memory (element
formats) or one read + one write per block (MX, NVFP4), with a small amax pre-pass where the
format has a per-tensor scale. ``_round_magnitude`` / ``_finish`` / ``_cast`` are the Triton
implementation of the one element cast (quant.elemwise), not a second definition: a kernel
cannot call torch code, and tests/test_quant_triton.py holds them to it bit for bit.

Why a second implementation: on CUDA the torch kernels are ~15 elementwise passes. These kernels
must give the torch backend's results bit for bit, so every step mirrors it:

- rounding works on integers: ``q = |x| * 2^(m - e)`` is exact (a power-of-two scaling);
  nearest rounding is ``(q + 2^23) - 2^23`` (the float adder's own ties-to-even), the other
  modes take the integer part from a float -> int conversion (truncation = floor for q >= 0);
  larger q, Inf and NaN are already integral and pass through;
- divisions are IEEE round-to-nearest (``tl.div_rn``), never the approximate GPU division;
- floating multiply-add contraction is off at launch, so no product is fused into an add;
- NaN never enters a min/max: block amax is taken over finite values and a block holding
  NaN/Inf is set to NaN afterwards, as the torch backend does.

Stochastic rounding reads a noise tensor drawn by the caller (the family, via quant.layout) from the caller's
``torch.Generator`` in the torch backend's own layout, so both backends give identical results
for the same generator state.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU
tensors; the tests use that to check them against the torch backend without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from .formats import E8M0_MAX_EXP, E8M0_MIN_EXP
from .interpreter import triton_interpreting
from .nvfp4_limits import ELEMENT_MAX, SCALE_MAX, SCALE_MIN, SCALE_PARAMS
from .scales import QuantizerOptions

#: rounding mode name -> the kernels' constexpr code
ROUNDING_CODE = {"nearest_even": 0, "nearest_away": 1, "toward_zero": 2, "stochastic": 3,
                 "hybrid": 4}
#: overflow encoding (ElemParams.overflow) -> constexpr code
OVERFLOW_CODE = {"inf": 0, "nan": 1, "max": 2}
#: MX scale mode -> constexpr code
SCALE_MODE_CODE = {"floor": 0, "ceil": 1, "rceil": 2}

# Launch shapes, from bench/tune_triton.py on an H100 (8192 x 8192 bf16; docs/quant.md)
ELEMENTS_PER_PROGRAM = 2048     # element and per-tensor kernels
BLOCKS_PER_PROGRAM = 128        # block kernels: 32-element blocks per program (scaled by size)
NUM_WARPS = {"elements": 4, "mx": 4, "nvfp4": 8}
_LAUNCH = {"enable_fp_fusion": False}
#: bfloat16 conversions in bit space under the interpreter only (compiled: one native cvt)
INTERPRETED: tl.constexpr = tl.constexpr(triton_interpreting())
# NVFP4's scale constants, from quant.family_nvfp4 (the one definition, read from FORMATS)
NV_ELEM_MAX: tl.constexpr = tl.constexpr(ELEMENT_MAX)
NV_SCALE_MIN: tl.constexpr = tl.constexpr(SCALE_MIN)
NV_SCALE_MAX: tl.constexpr = tl.constexpr(SCALE_MAX)
S_GRID_EMIN: tl.constexpr = tl.constexpr(SCALE_PARAMS.grid_emin)
S_GRID_EMAX: tl.constexpr = tl.constexpr(SCALE_PARAMS.grid_emax)
S_MBITS: tl.constexpr = tl.constexpr(SCALE_PARAMS.mbits)
S_OVERFLOW: tl.constexpr = tl.constexpr(OVERFLOW_CODE[SCALE_PARAMS.overflow])
E8M0_MIN: tl.constexpr = tl.constexpr(E8M0_MIN_EXP)
E8M0_MAX: tl.constexpr = tl.constexpr(E8M0_MAX_EXP)


# ---- shared device functions ---------------------------------------------------------------

@triton.jit
def _exponent(a):
    """floor(log2(a)) of non-negative float32 a from its bits (-127 zero/subnormal, 128 Inf/NaN)."""
    return (a.to(tl.int32, bitcast=True) >> 23) - 127


@triton.jit
def _pow2(k):
    """2^k as float32 for integer k in [-126, 127]."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_any(k):
    """2^k as float32 for integer k in [-149, 127] (float32 subnormal powers included)."""
    normal = (tl.maximum(k, -126) + 127) << 23
    sub = tl.full(k.shape, 1, tl.int32) << tl.minimum(tl.maximum(k + 149, 0), 22)
    return tl.where(k >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def _ceil_log2(a):
    bits = a.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127
    frac = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.where(e == -127, e, e + frac)


@triton.jit
def _round_magnitude(a, noise, GRID_EMIN: tl.constexpr, GRID_EMAX: tl.constexpr,
                     MBITS: tl.constexpr, TAPERED: tl.constexpr, ROUNDING: tl.constexpr):
    """elemwise.round_magnitude_: non-negative float32 a onto the format grid, unsaturated.

    One power of two scales q when 2^(m-e) and 2^(e-m) are both normal floats (every format
    but bf16, which splits it in two, as the torch backend does)."""
    e = tl.minimum(tl.maximum(_exponent(a), GRID_EMIN), GRID_EMAX)
    if TAPERED:
        ae = tl.abs(e)
        m = 3 - (ae >= 4).to(tl.int32) - (ae >= 8).to(tl.int32) - (ae >= 16).to(tl.int32)
    else:
        m = MBITS
    single: tl.constexpr = TAPERED or ((MBITS - GRID_EMIN <= 126) and (GRID_EMAX - MBITS <= 126))
    if single:
        q = a * _pow2(m - e)
    else:
        q = (a * ((128 - e) << 23).to(tl.float32, bitcast=True)) * (2.0 ** (MBITS - 1))
    if ROUNDING <= 1:
        # nearest: (q + 2^23) - 2^23 is q rounded to an integer, ties to even, for
        # 0 <= q < 2^22 (two exact-by-construction float adds); larger q, Inf and NaN are
        # integral already. Ties away: one step up where the even neighbour lies below a tie.
        small = q < 4194304.0
        r = tl.where(small, (q + 8388608.0) - 8388608.0, q)
        if ROUNDING == 1:
            r = tl.where((q - r) == 0.5, r + 1.0, r)
    else:
        small = q < 8388608.0                  # below 2^23: q may have a fraction
        qs = tl.where(small, q, 0.0)
        fl = qs.to(tl.int32)                   # truncation = floor for q >= 0
        frac = qs - fl.to(tl.float32)          # exact
        if ROUNDING == 2:      # toward zero
            up = frac < 0.0
        elif ROUNDING == 3:    # stochastic
            up = noise < frac
        else:                  # hybrid (HiF8): ties away for |E| <= 3, stochastic above
            up = tl.where(tl.abs(e) >= 4, noise < frac, frac >= 0.5)
        r = tl.where(small, (fl + up.to(tl.int32)).to(tl.float32), q)
    if single:
        return r * _pow2(e - m)
    return (r * (2.0 ** (-MBITS))) * _pow2(e)


@triton.jit
def _finish(r, x, MAX_NORMAL: tl.constexpr, OVERFLOW: tl.constexpr, SATURATE: tl.constexpr,
            SIGNED_ZERO: tl.constexpr):
    """elemwise.finish: saturation / overflow encoding, the sign of x, HiF8's single zero."""
    if SATURATE or OVERFLOW == 2:
        r = tl.where(r > MAX_NORMAL, MAX_NORMAL, r)
    elif OVERFLOW == 0:
        r = tl.where(r > MAX_NORMAL, float("inf"), r)
    else:
        r = tl.where(r > MAX_NORMAL, float("nan"), r)
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    r = ((r.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | sign).to(tl.float32, bitcast=True)
    if not SIGNED_ZERO:
        r = tl.where(r == 0.0, 0.0, r)
    return r


@triton.jit
def _cast(v, noise, GRID_EMIN: tl.constexpr, GRID_EMAX: tl.constexpr, MBITS: tl.constexpr,
          TAPERED: tl.constexpr, ROUNDING: tl.constexpr, MAX_NORMAL: tl.constexpr,
          OVERFLOW: tl.constexpr, SATURATE: tl.constexpr, SIGNED_ZERO: tl.constexpr):
    """elemwise.cast_elements on float32 v."""
    r = _round_magnitude(tl.abs(v), noise, GRID_EMIN, GRID_EMAX, MBITS, TAPERED, ROUNDING)
    return _finish(r, v, MAX_NORMAL, OVERFLOW, SATURATE, SIGNED_ZERO)


@triton.jit
def load_f32(ptr, offs, mask):
    """Load as float32. Under the interpreter bfloat16 is widened in bit space (exact), because
    its conversion mishandles bfloat16 subnormals; compiled, the native widening is exact."""
    raw = tl.load(ptr + offs, mask=mask, other=0.0)
    if INTERPRETED and ptr.dtype.element_ty == tl.bfloat16:
        bits = (raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << 16
        return bits.to(tl.float32, bitcast=True)
    return raw.to(tl.float32)


@triton.jit
def _to_output(y, out_ptr):
    """float32 y in the output's dtype, rounded to nearest even (native conversion when
    compiled). Under the interpreter bfloat16 is rounded in bit space and narrowed by a bit cast,
    because the interpreter truncates float32 -> bfloat16 and flushes its subnormals."""
    if INTERPRETED and out_ptr.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.int32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(y != y, bits >> 16, rounded)     # NaN: keep it a NaN
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return y.to(out_ptr.dtype.element_ty)


# ---- kernels -------------------------------------------------------------------------------

@triton.jit
def _elements_kernel(x_ptr, y_ptr, noise_ptr, scale_ptr, inv_ptr, n,
                     HAS_NOISE: tl.constexpr, HAS_SCALE: tl.constexpr,
                     GRID_EMIN: tl.constexpr, GRID_EMAX: tl.constexpr, MBITS: tl.constexpr,
                     TAPERED: tl.constexpr, ROUNDING: tl.constexpr, MAX_NORMAL: tl.constexpr,
                     OVERFLOW: tl.constexpr, SATURATE: tl.constexpr, SIGNED_ZERO: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Element casts; with HAS_SCALE the per-tensor scaled cast cast(x * s) * (1 / s)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = load_f32(x_ptr, offs, mask)
    if HAS_NOISE:
        noise = tl.load(noise_ptr + offs, mask=mask, other=1.0)
    else:
        noise = 0.0
    if HAS_SCALE:
        v = v * tl.load(scale_ptr)
    y = _cast(v, noise, GRID_EMIN, GRID_EMAX, MBITS, TAPERED, ROUNDING, MAX_NORMAL, OVERFLOW,
              SATURATE, SIGNED_ZERO)
    if HAS_SCALE:
        y = y * tl.load(inv_ptr)
    tl.store(y_ptr + offs, _to_output(y, y_ptr), mask=mask)


@triton.jit
def _finite_amax_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Per-program max |x| over finite values (0 where none); the caller reduces the partials."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = tl.abs(load_f32(x_ptr, offs, offs < n))
    a = tl.where(a < float("inf"), a, 0.0)
    tl.store(out_ptr + pid, tl.max(a, axis=0))


@triton.jit
def _block_tile(x_ptr, noise_ptr, nblocks, n, inner, nkb, HAS_NOISE: tl.constexpr,
                BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, ROWS: tl.constexpr,
                ALIGNED: tl.constexpr):
    """Load a tile of ROWS blocks of the tensor viewed as [outer, n, inner], blocks of BLOCK
    along n (the quantization axis); consecutive blocks step along ``inner`` first, so loads
    are coalesced whether or not the axis is the last one. ALIGNED (axis last, n a multiple of
    BLOCK): block b is elements b*BLOCK .. b*BLOCK+BLOCK-1, one contiguous tile (vector loads).
    Returns offsets, mask, values, noise and per-block (finite amax, has NaN/Inf)."""
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BLOCK_P2)
    if ALIGNED:
        offs = b[:, None] * BLOCK + j[None, :]
        mask = (b < nblocks)[:, None] & (j < BLOCK)[None, :]
    else:
        i = b % inner
        t = b // inner
        kb = t % nkb
        o = t // nkb
        pos = kb[:, None] * BLOCK + j[None, :]
        mask = (b < nblocks)[:, None] & (j < BLOCK)[None, :] & (pos < n)
        offs = (o * n)[:, None] * inner + pos * inner + i[:, None]
    v = load_f32(x_ptr, offs, mask)
    if HAS_NOISE:
        noise = tl.load(noise_ptr + offs, mask=mask, other=1.0)
    else:
        noise = 0.0
    a = tl.abs(v)
    bad = (a != a) | (a == float("inf"))
    amax = tl.max(tl.where(bad, 0.0, a), axis=1)
    nonfinite = tl.max(bad.to(tl.int32), axis=1) > 0
    return offs, mask, v, noise, amax, nonfinite


@triton.jit
def _mx_scales(amax, EMAX_ELEM: tl.constexpr, SCALE_MODE: tl.constexpr,
               MAX_NORMAL: tl.constexpr):
    """family_mx's scales per block: (encode 2^-s, decode 2^s), s the clamped E8M0 exponent."""
    if SCALE_MODE == 0:
        s = _exponent(amax) - EMAX_ELEM
    elif SCALE_MODE == 1:
        s = _ceil_log2(amax) - EMAX_ELEM
    else:
        s = _ceil_log2(tl.div_rn(amax, MAX_NORMAL))
        bound = MAX_NORMAL * _pow2_any(tl.minimum(tl.maximum(s, -149), 127))
        s = tl.where(amax > bound, s + 1, s)
    s = tl.minimum(tl.maximum(s, E8M0_MIN), E8M0_MAX)
    return _pow2_any(-s), _pow2_any(s)


@triton.jit
def _nvfp4_scales(amax, st_ptr):
    """family_nvfp4's scales per block: (the divisor, never 0; decode s_b * s_t), s_b the E4M3
    block scale (family_nvfp4.block_scale: nearest even, saturating), s_t loaded."""
    s_t = tl.load(st_ptr)
    raw = tl.div_rn(tl.div_rn(amax, NV_ELEM_MAX), s_t)
    raw = tl.where(raw < NV_SCALE_MIN, NV_SCALE_MIN,
                   tl.where(raw > NV_SCALE_MAX, NV_SCALE_MAX, raw))
    s_b = _cast(raw, 0.0, S_GRID_EMIN, S_GRID_EMAX, S_MBITS, False, 0, NV_SCALE_MAX, S_OVERFLOW,
                True, True)
    denom = s_b * s_t
    return tl.where(denom > 0.0, denom, 1.0), denom


# ---- the block families' scale rules (data for the one block kernel) -----------------------
# A rule is ``encode(v, amax, st_ptr, EMAX_ELEM, SCALE_MODE, MAX_NORMAL) -> (encoded v,
# decode)``: the tile v [ROWS, BLOCK] scaled for the element cast, and the factor per block
# the cast values are multiplied back by; ``st_ptr`` points at a per-tensor scale (two-level
# families) and the constants are the quantizer's.

@triton.jit
def _mx_encode(v, amax, st_ptr, EMAX_ELEM: tl.constexpr, SCALE_MODE: tl.constexpr,
               MAX_NORMAL: tl.constexpr):
    """MX: x * 2^-s, decoded by 2^s."""
    enc, dec = _mx_scales(amax, EMAX_ELEM, SCALE_MODE, MAX_NORMAL)
    return v * enc[:, None], dec


@triton.jit
def _nvfp4_encode(v, amax, st_ptr, EMAX_ELEM: tl.constexpr, SCALE_MODE: tl.constexpr,
                  MAX_NORMAL: tl.constexpr):
    """NVFP4: x / (s_b * s_t) (IEEE division), decoded by s_b * s_t."""
    enc, dec = _nvfp4_scales(amax, st_ptr)
    return tl.div_rn(v, enc[:, None]), dec


@dataclass(frozen=True)
class BlockScaleRule:
    """A blocked family's scale rule on the Triton backend: its ``encode`` function (above)
    and the warps its kernel launches with. The family passes it to :func:`quantize_blocks`;
    the kernel calls it and names no family."""

    encode: Any
    num_warps: int


MX_RULE = BlockScaleRule(_mx_encode, NUM_WARPS["mx"])
NVFP4_RULE = BlockScaleRule(_nvfp4_encode, NUM_WARPS["nvfp4"])


@triton.jit
def _block_kernel(x_ptr, y_ptr, noise_ptr, st_ptr, nblocks, n, inner, nkb,
                  HAS_NOISE: tl.constexpr, SCALE_RULE: tl.constexpr, EMAX_ELEM: tl.constexpr,
                  SCALE_MODE: tl.constexpr,
                  GRID_EMIN: tl.constexpr, GRID_EMAX: tl.constexpr, MBITS: tl.constexpr,
                  TAPERED: tl.constexpr, ROUNDING: tl.constexpr, MAX_NORMAL: tl.constexpr,
                  OVERFLOW: tl.constexpr, SATURATE: tl.constexpr, SIGNED_ZERO: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, ROWS: tl.constexpr,
                  ALIGNED: tl.constexpr):
    """The block families' quantizer: the family's SCALE_RULE per block (a BlockScaleRule's
    ``encode``), the element cast, the decode; a block holding NaN/Inf becomes all NaN."""
    offs, mask, v, noise, amax, nonfinite = _block_tile(
        x_ptr, noise_ptr, nblocks, n, inner, nkb, HAS_NOISE, BLOCK, BLOCK_P2, ROWS, ALIGNED)
    v, dec = SCALE_RULE(v, amax, st_ptr, EMAX_ELEM, SCALE_MODE, MAX_NORMAL)
    y = _cast(v, noise, GRID_EMIN, GRID_EMAX, MBITS, TAPERED, ROUNDING, MAX_NORMAL, OVERFLOW,
              SATURATE, SIGNED_ZERO) * dec[:, None]
    y = tl.where(nonfinite[:, None], float("nan"), y)
    tl.store(y_ptr + offs, _to_output(y, y_ptr), mask=mask)


# ---- host side -----------------------------------------------------------------------------

def _elem_constants(q: QuantizerOptions) -> dict:
    p = q.params
    return dict(GRID_EMIN=p.grid_emin, GRID_EMAX=p.grid_emax, MBITS=p.mbits, TAPERED=p.tapered,
                ROUNDING=ROUNDING_CODE[q.rounding], MAX_NORMAL=float(p.max_normal),
                OVERFLOW=OVERFLOW_CODE[p.overflow], SATURATE=bool(q.saturate),
                SIGNED_ZERO=p.signed_zero)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over finite values of contiguous x (0-dim float32 on x's device; 0 if none)."""
    n = x.numel()
    nprog = triton.cdiv(n, ELEMENTS_PER_PROGRAM)
    partial = torch.empty(nprog, dtype=torch.float32, device=x.device)
    _finite_amax_kernel[(nprog,)](x, partial, n, BLOCK=ELEMENTS_PER_PROGRAM)
    return partial.amax()


def cast_elements(x: torch.Tensor, q: QuantizerOptions, noise: Optional[torch.Tensor] = None,
                  scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Element cast of contiguous x (any supported dtype) as ``q`` configures it, result in
    x's dtype; with ``scale`` (0-dim float32) the per-tensor scaled cast, inverse computed as
    the torch backend does."""
    y = torch.empty_like(x)
    n = x.numel()
    inv = (1.0 / scale) if scale is not None else None
    _elements_kernel[(triton.cdiv(n, ELEMENTS_PER_PROGRAM),)](
        x, y, noise if noise is not None else x, scale if scale is not None else x,
        inv if inv is not None else x, n, HAS_NOISE=noise is not None,
        HAS_SCALE=scale is not None, BLOCK=ELEMENTS_PER_PROGRAM,
        **_elem_constants(q), num_warps=NUM_WARPS["elements"], **_LAUNCH)
    return y


def _block_geometry(x: torch.Tensor, axis: int, block: int) -> tuple[int, int, int, int]:
    """(n, inner, blocks per row, total blocks) of contiguous x blocked along ``axis``."""
    shape = x.shape
    n = shape[axis]
    inner = 1
    for d in shape[axis + 1:]:
        inner *= d
    outer = x.numel() // max(n * inner, 1)
    nkb = triton.cdiv(n, block)
    return n, inner, nkb, outer * nkb * inner


def quantize_blocks(x: torch.Tensor, q: QuantizerOptions, rule: BlockScaleRule,
                    noise: Optional[torch.Tensor] = None,
                    tensor_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Block fake quantization of contiguous x as ``q`` configures it (``q.axis`` non-negative,
    blocks of ``q.block``), the scales by the family's ``rule``; ``tensor_scale``: the 0-dim
    float32 per-tensor scale of a two-level rule."""
    y = torch.empty_like(x)
    n, inner, nkb, nblocks = _block_geometry(x, q.axis, q.block)
    p2 = triton.next_power_of_2(q.block)
    rows = max(1, BLOCKS_PER_PROGRAM * 32 // p2)
    _block_kernel[(triton.cdiv(nblocks, rows),)](
        x, y, noise if noise is not None else x,
        tensor_scale if tensor_scale is not None else x, nblocks, n, inner, nkb,
        HAS_NOISE=noise is not None, SCALE_RULE=rule.encode, EMAX_ELEM=q.spec.emax,
        SCALE_MODE=SCALE_MODE_CODE[q.scale_mode], BLOCK=q.block, BLOCK_P2=p2, ROWS=rows,
        ALIGNED=inner == 1 and n % q.block == 0, **_elem_constants(q),
        num_warps=rule.num_warps, **_LAUNCH)
    return y
