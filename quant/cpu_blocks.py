"""The MX, NVFP4 and element-format quantizers of a float32 CPU tensor in one pass: a small C
kernel.

Why C: Inductor's kernels of quant.family_mx / quant.family_nvfp4 reduce each block's amax
horizontally across vector lanes and NVFP4's reads x in two graphs; this loop reads a block
once, takes its amax as the integer maximum of the magnitudes' bits (non-negative floats order
as their bits; NaN and Inf lie above every finite value, which marks the block poisoned), and
casts it from registers. The arithmetic is the torch kernels', operation for operation, in
IEEE float32 (-ffp-contract=off: no fused multiply-add; no fast-math): the scales by the same
bit rules (quant.family_mx.shared_exponent, quant.family_nvfp4.block_scale), the element cast
by the float adder (quant.elemwise's nearest-even rounding), saturation / overflow encoding,
sign and single zero as quant.elemwise.finish, poisoned blocks all NaN. NVFP4's per-tensor
scale comes from the kernel's finite amax through the torch definition
(quant.family_nvfp4.tensor_scale_of_amax).

The element formats (no scale) take the same element cast (``lowp_elem``), or HiF8's ties-away
rounding on its tapered grid from the bits (quant.elemwise's _round_tapered_away); which
rounding takes which C cast is :data:`CASTS` (:func:`cast_code`).

When: a float32 contiguous CPU tensor (blocked formats: blocks along its last axis,
nearest-even rounding), where quant.accel would compile (``QUANT_COMPILE`` not off, large
enough). Built on first such
use by quant.cbuild, then checked bit for bit against the torch kernels on a probe that covers
every MX element format, NVFP4 and every element format a C cast takes, every scale mode, saturating or not, ties, subnormals,
NaN/Inf, overflow and zero blocks. No compiler, a failed build or a probe that disagrees: the
torch path stays (said once on stderr for the last two); results never change, only speed.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from . import accel, cbuild
from .elemwise import ElemParams, adder_rounds
from .formats import FORMATS, SCALE_MODES, SCALING_MX
from .layout import quantize_blocked, to_blocks

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(LOWP_NO_CLONES)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline uint32_t bits_of(float v) { uint32_t b; memcpy(&b, &v, 4); return b; }
static inline float float_of(uint32_t b) { float v; memcpy(&v, &b, 4); return v; }

/* 2^k for integer k in [-149, 127] (subnormal powers included), from the bits */
static inline float pow2(int32_t k) {
    return k >= -126 ? float_of((uint32_t)(k + 127) << 23) : float_of(1u << (k + 149));
}
/* ceil(log2(a)) of non-negative a from its bits, -127 for zero and subnormals */
static inline int32_t ceil_log2(uint32_t b) {
    int32_t e = (int32_t)(b >> 23) - 127;
    return e == -127 ? e : e + ((b & 0x7FFFFF) != 0);
}

/* the element cast's constants: grid exponent clamp (biased, shifted), adder offset, top */
typedef struct { int32_t lo, hi, off; float maxn, over; int sat, signed_zero; } elem_t;

/* quant.elemwise: nearest-even by the float adder, then finish (saturate or encode overflow,
   sign of v, single zero) */
static inline float cast_elem(float v, const elem_t *P) {
    float a = fabsf(v);
    int32_t eb = (int32_t)(bits_of(a) & 0x7F800000);
    eb = eb < P->lo ? P->lo : (eb > P->hi ? P->hi : eb);
    float c = float_of((uint32_t)(eb + P->off));
    float r = (a + c) - c;
    if (P->sat) r = r > P->maxn ? P->maxn : r;
    else r = r > P->maxn ? P->over : r;
    r = copysignf(r, v);
    return P->signed_zero ? r : r + 0.0f;
}

/* quant.elemwise's ties-away rounding on HiF8's tapered grid from the bits, then finish:
   m(e) = 4 - floor(log2(clamp(|e|, 2, 16))) mantissa bits kept at grid exponent e (the
   exponent field of that small int's float), half of the dropped part added and cleared;
   below 2^emin only 0 and 2^emin (the tie goes up); NaN stays NaN */
typedef struct { int32_t emin, emax; float bottom, half_bottom; } taper_t;
static inline float cast_tapered_away(float v, const elem_t *P, const taper_t *T) {
    float a = fabsf(v);
    uint32_t b = bits_of(a);
    int32_t e = (int32_t)(b >> 23) - 127;
    e = e < T->emin ? T->emin : (e > T->emax ? T->emax : e);
    int32_t ae = e < 0 ? -e : e;
    ae = ae < 2 ? 2 : (ae > 16 ? 16 : ae);
    int32_t m = 4 + 127 - (int32_t)(bits_of((float)ae) >> 23);
    uint32_t half = 1u << (22 - m);
    float r = float_of((b + half) & ~((half << 1) - 1u));
    r = a < T->bottom ? (a >= T->half_bottom ? T->bottom : 0.0f) : r;
    r = a == a ? r : a;
    if (P->sat) r = r > P->maxn ? P->maxn : r;
    else r = r > P->maxn ? P->over : r;
    r = copysignf(r, v);
    return P->signed_zero ? r : r + 0.0f;
}

static inline uint32_t block_amax_bits(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t j = 0; j < n; j++) { uint32_t b = bits_of(x[j]) & 0x7FFFFFFF; m = b > m ? b : m; }
    return m;
}

/* quant.family_mx.shared_exponent; mode: 0 floor, 1 ceil, 2 rceil (SCALE_MODE_CODES) */
static inline int32_t mx_exponent(uint32_t m, int mode, int32_t emax_elem, float maxn) {
    int32_t s;
    if (mode == 0) s = (int32_t)(m >> 23) - 127 - emax_elem;
    else if (mode == 1) s = ceil_log2(m) - emax_elem;
    else {
        float a = float_of(m);
        s = ceil_log2(bits_of(a / maxn));
        int32_t k = s < -149 ? -149 : (s > 127 ? 127 : s);
        if (a > maxn * pow2(k)) s += 1;
    }
    return s < -127 ? -127 : (s > 127 ? 127 : s);
}

/* ask for the cache lines AHEAD elements on (a hint, never a fault: the amax pass reads
   about a third faster out of cache) */
#define AHEAD 2048
static inline void ask_ahead(const float *x, int64_t n) {
#if defined(__GNUC__)
    for (int64_t k = 0; k < n; k += 16) __builtin_prefetch(x + k + AHEAD);
#else
    (void)x; (void)n;
#endif
}

/* Blocks are taken G at a time: their amaxes, then their scales (vectorized across the
   blocks), then their elements; a poisoned block (amax NaN or Inf) is all NaN. */
#define G 16
static inline void mx_group(const float *x, float *y, int64_t nb, int64_t B, int mode,
                            int32_t emax_elem, const elem_t *P) {
    uint32_t m[G]; float enc[G], dec[G];
    ask_ahead(x, nb * B);
    for (int64_t b = 0; b < nb; b++) m[b] = block_amax_bits(x + b * B, B);
    for (int64_t b = 0; b < nb; b++) {
        int32_t s = mx_exponent(m[b], mode, emax_elem, P->maxn);
        enc[b] = pow2(-s); dec[b] = pow2(s);
    }
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * B; float *yb = y + b * B;
        const float e = enc[b], d = dec[b]; const int bad = m[b] >= 0x7F800000;
        for (int64_t j = 0; j < B; j++) { float v = cast_elem(xb[j] * e, P) * d; yb[j] = bad ? NAN : v; }
    }
}

/* quant.family_nvfp4: s_b = e4m3(clamp((amax_b / 6) / s_t, 2^-9, 448)), x / (s_b * s_t) */
static inline void nv_group(const float *x, float *y, int64_t nb, int64_t B, float s_t,
                            float elem_max, float smin, float smax, const elem_t *S,
                            const elem_t *P) {
    uint32_t m[G]; float enc[G], dec[G];
    ask_ahead(x, nb * B);
    for (int64_t b = 0; b < nb; b++) m[b] = block_amax_bits(x + b * B, B);
    for (int64_t b = 0; b < nb; b++) {
        float raw = (float_of(m[b]) / elem_max) / s_t;
        raw = raw < smin ? smin : (raw > smax ? smax : raw);
        float denom = cast_elem(raw, S) * s_t;
        enc[b] = denom > 0.0f ? denom : 1.0f; dec[b] = denom;
    }
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * B; float *yb = y + b * B;
        const float e = enc[b], d = dec[b]; const int bad = m[b] >= 0x7F800000;
        for (int64_t j = 0; j < B; j++) { float v = cast_elem(xb[j] / e, P) * d; yb[j] = bad ? NAN : v; }
    }
}

static elem_t elem_of(const int32_t *ip, const float *fp) {
    elem_t P = {(ip[0] + 127) << 23, (ip[1] + 127) << 23, (23 - ip[2]) << 23, fp[0], fp[1],
                ip[3], ip[4]};
    return P;
}

/* Rows of `cols` values in blocks of `block` along each row (the last partial), G blocks
   at a time. The block lengths 16 and 32 get loops of their own (constant trip counts
   vectorize). */
#define ROWS(GROUP)                                                                       \
    const int64_t whole = cols / block, tail = cols - whole * block;                      \
    for (int64_t r = 0; r < rows; r++) {                                                  \
        const float *xr = x + r * cols; float *yr = y + r * cols;                         \
        for (int64_t k = 0; k < whole; k += G) {                                          \
            int64_t nb = whole - k < G ? whole - k : G;                                   \
            if (block == 32) GROUP(xr + k * 32, yr + k * 32, nb, 32);                     \
            else if (block == 16) GROUP(xr + k * 16, yr + k * 16, nb, 16);                \
            else GROUP(xr + k * block, yr + k * block, nb, block);                        \
        }                                                                                 \
        if (tail) GROUP(xr + whole * block, yr + whole * block, 1, tail);                 \
    }

/* ip: grid_emin, grid_emax, mbits, saturate, signed_zero, mode, emax_elem; fp: max_normal,
   overflow value */
CLONES void lowp_mx_rows(const float *x, float *y, int64_t rows, int64_t cols, int64_t block,
                         const int32_t *ip, const float *fp) {
    const elem_t P = elem_of(ip, fp);
    const int mode = ip[5];
    const int32_t emax_elem = ip[6];
#define MX_CALL(xp, yp, nb, B) mx_group(xp, yp, nb, B, mode, emax_elem, &P)
    ROWS(MX_CALL)
}

/* ip, fp: the element's as lowp_mx_rows' (mode unused), then at ip[7..] / fp[2..] the
   scale's; fp[4..6]: the element max, the scale's clamp [min, max]; s_t: the tensor scale */
CLONES void lowp_nvfp4_rows(const float *x, float *y, int64_t rows, int64_t cols,
                            int64_t block, const int32_t *ip, const float *fp, float s_t) {
    const elem_t P = elem_of(ip, fp), S = elem_of(ip + 7, fp + 2);
    const float elem_max = fp[4], smin = fp[5], smax = fp[6];
#define NV_CALL(xp, yp, nb, B) nv_group(xp, yp, nb, B, s_t, elem_max, smin, smax, &S, &P)
    ROWS(NV_CALL)
}

/* The element cast of n values (no scale; ip, fp as lowp_mx_rows'): kind 0 nearest-even by
   the float adder, 1 ties away on the tapered grid (fp[2], fp[3]: 2^grid_emin and half of it) */
CLONES void lowp_elem(const float *x, float *y, int64_t n, int kind, const int32_t *ip,
                      const float *fp) {
    const elem_t P = elem_of(ip, fp);
    if (kind == 0) {
        for (int64_t i = 0; i < n; i++) y[i] = cast_elem(x[i], &P);
    } else {
        const taper_t T = {ip[0], ip[1], fp[2], fp[3]};
        for (int64_t i = 0; i < n; i++) y[i] = cast_tapered_away(x[i], &P, &T);
    }
}

/* quant.scales.finite_amax: max |x| over the finite values (0 when none); 64 independent
   lanes (a plain running maximum does not vectorize) */
static inline uint32_t finite_bits(float v) {
    uint32_t b = bits_of(v) & 0x7FFFFFFF;
    return b & (0u - (uint32_t)(b < 0x7F800000));     /* branch-free: it vectorizes */
}
CLONES float lowp_finite_amax(const float *x, int64_t n) {
    uint32_t lane[64] = {0}, m = 0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        ask_ahead(x + i, 64);
        for (int j = 0; j < 64; j++) {
            uint32_t b = finite_bits(x[i + j]);
            lane[j] = b > lane[j] ? b : lane[j];
        }
    }
    for (; i < n; i++) { uint32_t b = finite_bits(x[i]); m = b > m ? b : m; }
    for (int j = 0; j < 64; j++) m = lane[j] > m ? lane[j] : m;
    return float_of(m);
}
"""

#: the MX scale mode -> its code in the C kernel
SCALE_MODE_CODES = {"floor": 0, "ceil": 1, "rceil": 2}
assert set(SCALE_MODE_CODES) == set(SCALE_MODES)
_FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math")
#: the quantizer's overflow encoding -> the value a too-large magnitude becomes (saturate off)
_OVERFLOW = {"inf": float("inf"), "nan": float("nan"), "max": None}


def elem_args(p: ElemParams, saturate: bool) -> tuple[list[int], list[float]]:
    """The element cast's constants as the C kernels read them (ints, floats)."""
    sat = saturate or p.overflow == "max"
    over = _OVERFLOW[p.overflow]
    return ([p.grid_emin, p.grid_emax, p.mbits, int(sat), int(p.signed_zero)],
            [p.max_normal, p.max_normal if over is None else over])


class CpuBlocksState:
    """The loaded library (or why there is none), once per process (``CPU_BLOCKS``)."""

    def __init__(self) -> None:
        self.lib: Optional[ctypes.CDLL] = None
        self.tried = False
        self.error: Optional[BaseException] = None
        #: helper threads, one fewer than torch's intra-op threads (built on first use)
        self.pool: Optional[ThreadPoolExecutor] = None
        self.pool_size = 0
        self.pool_pid = 0     # the process the pool's threads live in (a forked child: none)


CPU_BLOCKS = CpuBlocksState()


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.lowp_mx_rows.argtypes = (p, p, i64, i64, i64, p, p)
    lib.lowp_mx_rows.restype = None
    lib.lowp_nvfp4_rows.argtypes = (p, p, i64, i64, i64, p, p, ctypes.c_float)
    lib.lowp_nvfp4_rows.restype = None
    lib.lowp_elem.argtypes = (p, p, i64, ctypes.c_int, p, p)
    lib.lowp_elem.restype = None
    lib.lowp_finite_amax.argtypes = (p, i64)
    lib.lowp_finite_amax.restype = ctypes.c_float
    return lib


def library(probe: Callable[[ctypes.CDLL], str]) -> Optional[ctypes.CDLL]:
    """The kernels, built and checked by ``probe`` ('' when they agree with the torch kernels,
    else what differs) on first use; None where they cannot be used."""
    state = CPU_BLOCKS
    if not state.tried:
        state.tried = True
        try:
            state.lib = _declare(ctypes.CDLL(str(cbuild.build(
                "quant_blocks", _SOURCE, _FLAGS, fallbacks=((), ("-DLOWP_NO_CLONES",))))))
        except (ImportError, OSError) as exc:   # no compiler: silently the torch path
            state.error = exc
            if cbuild.compiler() is not None:
                _say(f"the C block quantizer could not be built ({exc})")
            return None
        bad = probe(state.lib)
        if bad:
            state.lib, state.error = None, RuntimeError(bad)
            _say(f"the C block quantizer differs from the torch kernels ({bad})")
    return state.lib


def _say(what: str) -> None:
    print(f"quant: {what}; quantizing with the torch kernels (same results, slower)",
          file=sys.stderr, flush=True)


#: the C element casts: (rounding, whether the grid qualifies) -> the kernel's cast code; the
#: blocked kernels take code 0 only
CASTS = {("nearest_even", True): 0, ("nearest_away", True): 1}


def cast_code(q) -> Optional[int]:
    """The C element cast of quantizer ``q``: 0 nearest-even by the float adder (a fixed
    mantissa, quant.elemwise.adder_rounds), 1 ties away on HiF8's tapered grid; None: torch."""
    p = q.params
    fits = adder_rounds(p) if q.rounding == "nearest_even" else p.tapered
    return CASTS.get((q.rounding, fits))


def usable(x: torch.Tensor, q) -> bool:
    """Whether the C kernels take x as quantizer ``q`` configures them (module docstring):
    blocked families along the last axis with cast 0, element formats with either cast."""
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 1
            and x.numel() > 0 and x.is_contiguous() and CPU_BLOCKS.error is None):
        return False
    code = cast_code(q)
    if not q.family.blocked:
        return code is not None
    return code == 0 and q.axis in (-1, x.dim() - 1)


#: elements from which a call is split across torch's intra-op threads (below, one thread)
PARALLEL_MIN_NUMEL = 1 << 18


def _parts(n: int, numel: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of ``n`` rows (or elements), one per torch intra-op thread for a
    tensor of ``numel`` elements that is worth it, else one."""
    threads = min(torch.get_num_threads(), n)
    if threads < 2 or numel < PARALLEL_MIN_NUMEL:
        return [(0, n)]
    step = -(-n // threads)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _each(fn: Callable[[int, int], object], parts: list[tuple[int, int]]) -> list:
    """fn(start, stop) of every part, the first in this thread, the others in the helper
    threads (the C calls release the GIL); their results in order."""
    if len(parts) == 1:
        return [fn(*parts[0])]
    state = CPU_BLOCKS
    if state.pool_size < len(parts) - 1 or state.pool_pid != os.getpid():
        state.pool_size, state.pool_pid = len(parts) - 1, os.getpid()
        state.pool = ThreadPoolExecutor(state.pool_size, thread_name_prefix="quant-blocks")
    futures = [state.pool.submit(fn, *p) for p in parts[1:]]
    first = fn(*parts[0])
    return [first, *(f.result() for f in futures)]


def _rows_call(kernel, x: torch.Tensor, block: int, *args) -> torch.Tensor:
    """A rows kernel over x (rows of its last dimension) into a new tensor, split by rows."""
    cols = x.shape[-1]
    rows = x.numel() // cols
    y = torch.empty_like(x)
    xp, yp = x.data_ptr(), y.data_ptr()

    def part(r0: int, r1: int) -> None:
        kernel(xp + 4 * r0 * cols, yp + 4 * r0 * cols, r1 - r0, cols, block, *args)
    _each(part, _parts(rows, x.numel()))
    return y


def mx_rows(lib: ctypes.CDLL, x: torch.Tensor, q, mode: int) -> torch.Tensor:
    """x quantized by the MX kernel (scale mode code ``mode``: 0 floor, 1 ceil, 2 rceil)."""
    ints, floats = elem_args(q.params, q.saturate)
    ip = (ctypes.c_int32 * 7)(*ints, mode, q.spec.emax)
    fp = (ctypes.c_float * 2)(*floats)
    return _rows_call(lib.lowp_mx_rows, x, q.block, ip, fp)


def elem_cast(lib: ctypes.CDLL, x: torch.Tensor, q) -> torch.Tensor:
    """x cast element by element as ``q`` configures it (cast_code), into a new tensor,
    split across torch's intra-op threads."""
    ints, floats = elem_args(q.params, q.saturate)
    bottom = 2.0 ** q.params.grid_emin
    ip = (ctypes.c_int32 * 5)(*ints)
    fp = (ctypes.c_float * 4)(*floats, bottom, bottom / 2)
    y = torch.empty_like(x)
    xp, yp, code = x.data_ptr(), y.data_ptr(), cast_code(q)

    def part(i0: int, i1: int) -> None:
        lib.lowp_elem(xp + 4 * i0, yp + 4 * i0, i1 - i0, code, ip, fp)
    _each(part, _parts(x.numel(), x.numel()))
    return y


def finite_amax(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """quant.scales.finite_amax of contiguous float32 x, as a 0-dim tensor (the maximum of
    the parts' maxima: exact in any order)."""
    xp, n = x.data_ptr(), x.numel()
    maxima = _each(lambda i0, i1: lib.lowp_finite_amax(xp + 4 * i0, i1 - i0), _parts(n, n))
    return torch.tensor(max(maxima), dtype=torch.float32)


def nvfp4_rows(lib: ctypes.CDLL, x: torch.Tensor, q, s_t: float, scale: ElemParams,
               limits: tuple[float, float, float]) -> torch.Tensor:
    """x quantized by the NVFP4 kernel with tensor scale ``s_t``, block-scale constants
    ``scale`` (saturating) and (element max, scale min, scale max)."""
    ints, floats = elem_args(q.params, q.saturate)
    s_ints, s_floats = elem_args(scale, True)
    ip = (ctypes.c_int32 * 12)(*ints, 0, 0, *s_ints)
    fp = (ctypes.c_float * 7)(*floats, *s_floats, *limits)
    return _rows_call(lib.lowp_nvfp4_rows, x, q.block, ip, fp, s_t)


def kernels_for(x: torch.Tensor, q) -> Optional[ctypes.CDLL]:
    """The C kernels when they take x as ``q`` configures them (built and probed on first
    use), else None: the caller runs its torch kernels."""
    if not (usable(x, q) and accel.compile_wanted(x.numel(), x.device.type)):
        return None
    return library(lambda lib: probe_mismatch(lib, type(q)))


class CBlocked:
    """What a blocked family (quant.family_mx, quant.family_nvfp4) shares: float32 CPU tensors
    the C kernels take go through its ``quantize_c``, the rest through its torch kernels:
    ``blocks(xb, q, nz=None, dim=-1)`` over [..., nblocks, block] gathered along the last axis
    (what the C path is probed against), and ``inner_blocks``, derived from it once per family,
    over [..., nblocks, block, inner] with blocks taken in place (deterministic rounding; one
    function object per family: quant.accel caches its compiled kernel by that object)."""

    blocks: Callable
    inner_blocks: Callable

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "blocks" in cls.__dict__:
            blocks = cls.__dict__["blocks"].__func__

            def inner_blocks(xb, q):
                return blocks(xb, q, None, dim=-2)
            inner_blocks.__qualname__ = f"{cls.__name__}.inner_blocks"
            cls.inner_blocks = staticmethod(inner_blocks)

    def quantize(self, x, q, generator=None):
        lib = kernels_for(x, q)
        if lib is not None:
            return self.quantize_c(lib, x, q)
        return quantize_blocked(x, q, self.inner_blocks, self.blocks, generator)

    def reference(self, x: torch.Tensor, q) -> torch.Tensor:
        """The torch kernel on x (uncompiled): what the C path is probed against."""
        xb, restore = to_blocks(x, -1, q.block)
        return restore(self.blocks(xb, q.kernel))


def _probe_tensor(rows: int, cols: int) -> torch.Tensor:
    """Blocks of small integers times a power of two per block (many ties on every grid),
    from float32 subnormals to near the float32 maximum; zero blocks, signed zeros, NaN and
    +-Inf planted; the rows' last blocks partial."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-96, 97, (rows, cols), generator=g).float()
    powers = torch.randint(-150, 120, (rows, 1), generator=g).float()
    x = x * torch.pow(2.0, powers)
    x[1] = 0.0
    x[2, ::3] = -0.0
    x[3, 5], x[4, 40], x[5, 7] = float("nan"), float("inf"), -float("inf")
    x[6] = torch.randn(cols, generator=g) * 3e38
    x[7] = torch.randn(cols, generator=g)
    return x


def probe_mismatch(lib: ctypes.CDLL, quantizer: type) -> str:
    """'' when the C kernels equal the torch kernels bit for bit on the probe for every MX
    format and NVFP4 (every scale mode, saturating or not), else the first that differs.
    ``quantizer`` is the Quantizer class (passed in: the families call this module, so it
    imports neither them nor the quantizer); each family gives its torch kernel
    (``blocks``) and its C path (``quantize_c``)."""
    from .accel import same_bits

    x = _probe_tensor(24, 3 * 32 + 7)
    for spec in FORMATS.values():
        modes = SCALE_MODES if spec.scaling == SCALING_MX else SCALE_MODES[:1]
        for mode, saturate in itertools.product(modes, (True, False)):
            q = quantizer.of(spec, saturate=saturate,
                             **({"scale_mode": mode} if spec.scaling == SCALING_MX else {}))
            if not hasattr(q.family, "quantize_c") or not usable(x, q):
                continue
            if not same_bits(q.family.quantize_c(lib, x, q), q.family.reference(x, q)):
                return f"{spec.name}, scale_mode={mode}, saturate={saturate}"
    return ""
