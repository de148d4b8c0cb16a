"""The flight recorder's statistics of a CPU tensor in one pass: a small C kernel.

Why C: the torch path (tensor_capture.recorder.stats.host_row) makes four passes (dot, sum, amin,
amax), and more when a format is judged or a value is not finite, plus a Python call per pass;
at a small model's widths that is a tenth of the step. This kernel reads each element once and
keeps every statistic of schema.REC_STATS in 64 independent lanes the compiler vectorizes: sums
and sums of squares in float32 partials of PART values per lane, added in float64 (error bound:
gamma(PART) in float32 plus float64's), min / max, and, when a format is judged, its flush
(0 < |x| < flush) and saturation (|x| >= overflow) counts, compared in float32 as torch compares
a float32 tensor with a Python number. A NaN or an Inf (or a float32 partial that overflows)
makes those sums non-finite; then a general loop counts NaN and Inf (+-Inf saturate too) and
sums the finite values in float64. Counts, min and max equal the torch path's exactly; the sums
equal them on data whose partial sums are exact. The arithmetic of a lane does not depend on the
instruction set (no fused multiply-add), so neither does the row.

How it is built: no build step at install and no torch headers. On first use the source below is
compiled with the system C compiler (``$CC``, else cc / gcc / clang) into a shared library in a
cache folder (``$XDG_CACHE_HOME`` or ~/.cache, /megatron-lowp-tools), named by a hash of the
source, the flags and the compiler, written under a temporary name and renamed (ranks racing
each other each get a whole file), then loaded with ctypes and checked against the definitions
on a probe whose sums are exact. x86-64 builds carry AVX-512 / AVX2 / baseline clones of the
loop, picked for the CPU at load. Where no compiler works, or the probe disagrees, the recorder
keeps the torch path (it says so once): the numbers are the same, only slower.
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Any

import torch

from quant import cbuild

from .recorder.ring import COUNT, SEEN
from .recorder.stats import FLUSH, INF, MAX, MIN, N_STATS, NAN, SAT, SUM, SUMSQ, Judged, bounds

#: where the C code writes each value of a slot: the rows' indexes (schema.REC_STAT_ROWS), then
#: tensor_capture.recorder.ring's count and seen flag, as macros R_<NAME> (compile flags)
_PLACES = {"SUM": SUM, "SUMSQ": SUMSQ, "MIN": MIN, "MAX": MAX, "NAN": NAN, "INF": INF,
           "FLUSH": FLUSH, "SAT": SAT, "COUNT": COUNT, "SEEN": SEEN}

#: dimensions the kernel walks a strided tensor in (more: a contiguous copy first)
MAX_DIMS = 16
#: torch dtype -> the kernel's element code (float32; bfloat16 widened exactly in the loop)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

/* LANES independent accumulators (the compiler vectorizes across them without reordering any
   addition; lanes are combined in a fixed order), each summing PART values in float32 before
   adding the partial into float64. The arithmetic is the same whatever the instruction set
   (-ffp-contract=off: no fused multiply-add), so the result is too. PART and MAX_DIMS come from Python. */
#define LANES 64
#define CHUNK ((int64_t)LANES * PART)

#if defined(__x86_64__) && defined(__GNUC__) && !defined(LOWP_NO_CLONES)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline float load_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float load_bf16(const void *p, int64_t i) {
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;   /* the top half of a float */
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

typedef struct { double s[LANES], q[LANES]; float lo[LANES], hi[LANES]; int64_t c[4]; } acc_t;
enum { K_NAN, K_INF, K_FLUSH, K_SAT };

static void acc_init(acc_t *A) {
    memset(A, 0, sizeof *A);
    for (int j = 0; j < LANES; j++) { A->lo[j] = INFINITY; A->hi[j] = -INFINITY; }
}

/* The loop shared by the kernels: chunks of LANES x PART elements, then the tail, lane j
   taking element i + j of each row. STEP(j, v) updates lane j with value v; DONE() adds the
   chunk's float32 partials (and int32 counts) into A. Each row asks for the cache lines AHEAD
   elements on (data out of cache reads about a fifth faster; a hint only, never a fault). */
#define AHEAD 2048
#if defined(__GNUC__)
#define PREFETCH(x, ES, k) do { const char *b_ = (const char *)(x) + ((k) + AHEAD) * (ES);     \
    for (int c_ = 0; c_ < LANES * (ES); c_ += 64) __builtin_prefetch(b_ + c_); } while (0)
#else
#define PREFETCH(x, ES, k) do { } while (0)
#endif
#define LOOP(LOAD, ES, STEP, DONE)                                                           \
    int64_t i = 0;                                                                            \
    for (; i + CHUNK <= n; i += CHUNK) {                                                      \
        for (int p = 0; p < PART; p++) {                                                      \
            PREFETCH(x, ES, i + p * LANES);                                                   \
            for (int j = 0; j < LANES; j++) { float v = LOAD(x, i + p * LANES + j); STEP(j, v); } \
        }                                                                                     \
        DONE();                                                                               \
    }                                                                                         \
    for (int64_t k = 0; i + k < n; k++) { float v = LOAD(x, i + k); STEP((int)(k % LANES), v); } \
    DONE();

/* finite values assumed (the caller checks the sums): sum, sum of squares, min, max */
#define MOMENTS(NAME, LOAD, ES)                                                                   \
CLONES static void NAME(const void *x, int64_t n, float up, float fl, acc_t *A) {           \
    float s[LANES] = {0}, q[LANES] = {0};                                                     \
    float lo[LANES], hi[LANES];                                                               \
    (void)up; (void)fl;                                                                       \
    memcpy(lo, A->lo, sizeof lo); memcpy(hi, A->hi, sizeof hi);                               \
    LOOP(LOAD, ES, M_STEP, M_DONE)                                                               \
    memcpy(A->lo, lo, sizeof lo); memcpy(A->hi, hi, sizeof hi);                               \
}
#define M_STEP(j, v) do { s[j] += v; q[j] += v * v;                                           \
    lo[j] = v < lo[j] ? v : lo[j]; hi[j] = v > hi[j] ? v : hi[j]; } while (0)
#define M_DONE() do { for (int j = 0; j < LANES; j++) {                                      \
    A->s[j] += s[j]; A->q[j] += q[j]; s[j] = q[j] = 0.0f; } } while (0)

/* the same, with the format's flush (0 < |x| < fl) and saturation (|x| >= up) counts */
#define COUNTS(NAME, LOAD, ES)                                                                    \
CLONES static void NAME(const void *x, int64_t n, float up, float fl, acc_t *A) {           \
    float s[LANES] = {0}, q[LANES] = {0};                                                     \
    float lo[LANES], hi[LANES];                                                               \
    int32_t cf[LANES] = {0}, cs[LANES] = {0};                                                 \
    memcpy(lo, A->lo, sizeof lo); memcpy(hi, A->hi, sizeof hi);                               \
    LOOP(LOAD, ES, C_STEP, C_DONE)                                                               \
    memcpy(A->lo, lo, sizeof lo); memcpy(A->hi, hi, sizeof hi);                               \
}
#define C_STEP(j, v) do { float a_ = fabsf(v); M_STEP(j, v);                                  \
    cf[j] += (a_ < fl) & (a_ > 0.0f); cs[j] += a_ >= up; } while (0)
#define C_DONE() do { M_DONE(); for (int j = 0; j < LANES; j++) {                           \
    A->c[K_FLUSH] += cf[j]; A->c[K_SAT] += cs[j]; cf[j] = cs[j] = 0; } } while (0)

/* any values: NaN and +-Inf counted and left out of the moments, which accumulate in float64
   (no square or partial sum of finite values can overflow there) */
#define GENERAL(NAME, LOAD, ES)                                                                   \
CLONES static void NAME(const void *x, int64_t n, float up, float fl, acc_t *A) {           \
    float lo[LANES], hi[LANES];                                                               \
    int32_t cn[LANES] = {0}, ci[LANES] = {0}, cf[LANES] = {0}, cs[LANES] = {0};               \
    memcpy(lo, A->lo, sizeof lo); memcpy(hi, A->hi, sizeof hi);                               \
    LOOP(LOAD, ES, G_STEP, G_DONE)                                                               \
    memcpy(A->lo, lo, sizeof lo); memcpy(A->hi, hi, sizeof hi);                               \
}
#define G_STEP(j, v) do { float a_ = fabsf(v); int fin_ = a_ < INFINITY;                      \
    double d_ = fin_ ? (double)v : 0.0; A->s[j] += d_; A->q[j] += d_ * d_;                    \
    float l_ = fin_ ? v : INFINITY, h_ = fin_ ? v : -INFINITY;                                \
    lo[j] = l_ < lo[j] ? l_ : lo[j]; hi[j] = h_ > hi[j] ? h_ : hi[j];                         \
    cn[j] += v != v; ci[j] += a_ == INFINITY;                                                 \
    cf[j] += (a_ < fl) & (a_ > 0.0f); cs[j] += a_ >= up; } while (0)
#define G_DONE() do { for (int j = 0; j < LANES; j++) {                                      \
    A->c[K_NAN] += cn[j]; A->c[K_INF] += ci[j]; A->c[K_FLUSH] += cf[j]; A->c[K_SAT] += cs[j]; \
    cn[j] = ci[j] = cf[j] = cs[j] = 0; } } while (0)

MOMENTS(moments_f32, load_f32, 4)
MOMENTS(moments_bf16, load_bf16, 2)
COUNTS(counts_f32, load_f32, 4)
COUNTS(counts_bf16, load_bf16, 2)
GENERAL(general_f32, load_f32, 4)
GENERAL(general_bf16, load_bf16, 2)

typedef void (*kernel_t)(const void *, int64_t, float, float, acc_t *);
static const kernel_t KERNELS[3][2] = {{moments_f32, moments_bf16}, {counts_f32, counts_bf16},
                                       {general_f32, general_bf16}};

/* The elements: n contiguous ones at x (nd == 0), or a strided tensor of nd dimensions (sizes
   and strides in elements), gathered in row-major order CHUNK elements at a time into a buffer
   the kernel reads as contiguous: the same chunks as a contiguous copy's, so the same row.
   Dimensions of size 1 are dropped and neighbours that are one run in memory merged first; a
   run with unit stride is copied whole (memcpy), and whole chunks of it are read in place. */
typedef struct { const char *x; int64_t n; int nd; const int64_t *size, *stride; int esize; } src_t;

static int collapse(const src_t *S, int64_t *size, int64_t *stride) {
    int nd = 0;
    for (int d = 0; d < S->nd; d++) {
        if (S->size[d] == 1) continue;
        if (nd > 0 && stride[nd - 1] == S->stride[d] * S->size[d]) {
            size[nd - 1] *= S->size[d]; stride[nd - 1] = S->stride[d];
        } else { size[nd] = S->size[d]; stride[nd] = S->stride[d]; nd++; }
    }
    if (nd == 0) { size[0] = 1; stride[0] = 1; nd = 1; }
    return nd;
}

static void feed(kernel_t k, const src_t *S, float up, float fl, acc_t *A) {
    if (S->nd == 0) { k(S->x, S->n, up, fl, A); return; }
    if (S->n == 0) return;
    char buf[CHUNK * 4];
    int64_t size[MAX_DIMS], stride[MAX_DIMS], idx[MAX_DIMS] = {0}, fill = 0;
    const int es = S->esize, last = collapse(S, size, stride) - 1;
    const int64_t inner = size[last], step = stride[last] * es;
    for (;;) {
        const char *row = S->x;
        for (int d = 0; d < last; d++) row += idx[d] * stride[d] * es;
        for (int64_t j = 0; j < inner;) {
            if (step != es) {
                memcpy(buf + fill * es, row + j * step, (size_t)es); fill++; j++;
            } else if (fill == 0 && inner - j >= CHUNK) {     /* whole chunks: in place */
                int64_t whole = (inner - j) / CHUNK * CHUNK;
                k(row + j * es, whole, up, fl, A); j += whole;
                continue;
            } else {
                int64_t take = inner - j < CHUNK - fill ? inner - j : CHUNK - fill;
                memcpy(buf + fill * es, row + j * es, (size_t)(take * es)); fill += take; j += take;
            }
            if (fill == CHUNK) { k(buf, CHUNK, up, fl, A); fill = 0; }
        }
        int d = last - 1;
        while (d >= 0 && ++idx[d] == size[d]) idx[d--] = 0;
        if (d < 0) break;
    }
    if (fill) k(buf, fill, up, fl, A);
}

static void finish(const acc_t *A, double *out) {
    double s = 0.0, q = 0.0;
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < LANES; j++) {
        s += A->s[j]; q += A->q[j];
        lo = A->lo[j] < lo ? A->lo[j] : lo;
        hi = A->hi[j] > hi ? A->hi[j] : hi;
    }
    out[R_SUM] = s; out[R_SUMSQ] = q; out[R_MIN] = lo; out[R_MAX] = hi;
    out[R_NAN] = (double)A->c[K_NAN]; out[R_INF] = (double)A->c[K_INF];
    out[R_FLUSH] = (double)A->c[K_FLUSH]; out[R_SAT] = (double)A->c[K_SAT];
}

/* The row of the n elements of dtype code `dtype` (0 float32, 1 bfloat16) at x (contiguous
   when nd == 0, else nd <= MAX_DIMS sizes and strides) into out at R_<NAME>: sum, sum of squares,
   min, max (finite values), NaN, Inf, flush (0 < |x| < fl) and saturation (|x| >= up, +-Inf
   included) counts. The fast loops first (no format: the moments alone; a format: with its two counts);
   the general loop only when their sums are not finite (a NaN or an Inf present, or a float32
   partial overflowed). Returns 0, or -1 for an unknown code or too many dimensions. */
int lowp_rec_row(const void *x, int64_t n, int nd, const int64_t *size, const int64_t *stride,
                 int dtype, double up, double fl, double *out) {
    acc_t A;
    if ((dtype != 0 && dtype != 1) || nd < 0 || nd > MAX_DIMS) return -1;
    src_t S = {(const char *)x, n, nd, size, stride, dtype == 0 ? 4 : 2};
    acc_init(&A);
    feed(KERNELS[fl > 0.0 || up < INFINITY][dtype], &S, (float)up, (float)fl, &A);
    finish(&A, out);
    if (!(isfinite(out[R_SUM]) && isfinite(out[R_SUMSQ]))) {
        acc_init(&A);
        feed(KERNELS[2][dtype], &S, (float)up, (float)fl, &A);
        finish(&A, out);
    }
    return 0;
}

/* The recorder's slot: the row, the element count and a seen flag (1.0) at R_COUNT, R_SEEN. */
int lowp_rec_slot(const void *x, int64_t n, int nd, const int64_t *size, const int64_t *stride,
                  int dtype, double up, double fl, double *out) {
    int r = lowp_rec_row(x, n, nd, size, stride, dtype, up, fl, out);
    if (r == 0) { out[R_COUNT] = (double)n; out[R_SEEN] = 1.0; }
    return r;
}
"""

#: values per lane summed in float32 before the partial goes into float64 (the error bound of
#: the fast loops' sums: gamma(PART) in float32 on each partial, then float64 additions)
PART = 32
_FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math", f"-DPART={PART}", f"-DMAX_DIMS={MAX_DIMS}",
          *(f"-DR_{name}={index}" for name, index in _PLACES.items()))


class CpuStatsKernel:
    """The loaded library: :meth:`row_into` writes one tensor's row where it is told,
    :meth:`slot_into` a recorder slot (the row, its element count and seen flag)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = _declare(lib.lowp_rec_row)
        self._slot = _declare(lib.lowp_rec_slot)

    def row_into(self, x: torch.Tensor, fmt: Judged | None, out_address: int) -> bool:
        """The row of CPU tensor ``x`` judged against ``fmt`` into the N_STATS float64 values at
        ``out_address``. False, nothing written, for a dtype the kernel does not read (the
        caller takes the torch path)."""
        return self._call(self._fn, x, *bounds(fmt), out_address)

    def slot_into(self, x: torch.Tensor, up: float, fl: float, out_address: int) -> bool:
        """:meth:`row_into` with the bounds given (:func:`bounds`, computed once per slot by
        the caller), then x's element count and 1.0 (seen): tensor_capture.recorder.ring's
        slot, all of it in one call. False, nothing written, as :meth:`row_into`."""
        code = DTYPE_CODES.get(x.dtype)
        if code is not None and x.is_contiguous():      # the usual case, without a second frame
            self._slot(x.data_ptr(), x.numel(), 0, None, None, code, up, fl, out_address)
            return True
        return self._call(self._slot, x, up, fl, out_address)

    @staticmethod
    def _call(fn: Any, x: torch.Tensor, up: float, fl: float, out_address: int) -> bool:
        code = DTYPE_CODES.get(x.dtype)
        if code is None:
            return False
        if x.is_contiguous():
            fn(x.data_ptr(), x.numel(), 0, None, None, code, up, fl, out_address)
            return True
        if x.dim() > MAX_DIMS:
            x = x.detach().contiguous()
            fn(x.data_ptr(), x.numel(), 0, None, None, code, up, fl, out_address)
            return True
        dims = (ctypes.c_int64 * x.dim())
        fn(x.data_ptr(), x.numel(), x.dim(), dims(*x.shape), dims(*x.stride()), code, up, fl,
           out_address)                          # gathered in the kernel: no copy here
        return True


def _declare(fn: Any) -> Any:
    """The C signature both entry points share."""
    fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_double, ctypes.c_double,
                   ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


def load() -> CpuStatsKernel:
    """Compile (once per machine: the cache) and load the kernel, checked on the probe.
    Raises ImportError naming what failed (no compiler, a compile error, a wrong probe)."""
    try:
        # one build per machine (quant.cbuild: cached by a hash of the source, flags and
        # compiler, renamed into place); a compiler without target_clones: one plain build
        path = cbuild.build("recorder_stats", _SOURCE, _FLAGS, ((), ("-DLOWP_NO_CLONES",)))
        kernel = CpuStatsKernel(ctypes.CDLL(str(path)), path)
    except OSError as exc:                   # a compiler that cannot run, a library that won't load
        raise ImportError(f"the statistics kernel could not be built or loaded: {exc}") from exc
    bad = _probe_mismatch(kernel)
    if bad:
        raise ImportError(f"the compiled statistics kernel {path} disagrees with the "
                          f"definitions on its probe ({bad})")
    return kernel


def _probe_mismatch(kernel: CpuStatsKernel) -> str:
    """'' when the kernel's rows on a probe equal the definitions exactly (small integers: every
    sum exact in any order; NaN, +-Inf and a float32 partial that overflows send it to the
    general loop, a format's two counts to the counting loop), else what differs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (3 * 64 * PART + 37,), generator=g).float()
    probe = Judged("probe", 7.5, 0.5, False, None)
    for dtype in DTYPE_CODES:
        for fmt, plant in ((None, {}), (probe, {40: 0.25}), (probe, {3: math.nan, 5: math.inf,
                                                                     17: -math.inf})):
            v = x.clone()
            for i, value in plant.items():
                v[i] = value
            v = v.to(dtype)
            got = (ctypes.c_double * N_STATS)()
            kernel.row_into(v, fmt, ctypes.addressof(got))
            want = _reference(v, *bounds(fmt))
            if list(got) != want:
                return f"{dtype}, {fmt and fmt.name}: {list(got)} != {want}"
    return ""


def _reference(x: torch.Tensor, overflow: float, flush: float) -> list[float]:
    """The row by the definitions, in float64 (the probe's reference)."""
    a = x.double()
    finite = torch.isfinite(a)
    f = a[finite]
    absx = a.abs()
    row = [0.0] * N_STATS
    row[SUM], row[SUMSQ] = float(f.sum()), float((f * f).sum())
    row[MIN] = float(f.min()) if f.numel() else math.inf
    row[MAX] = float(f.max()) if f.numel() else -math.inf
    row[NAN], row[INF] = float(a.isnan().sum()), float(a.isinf().sum())
    row[FLUSH] = float(((absx < flush) & (absx > 0)).sum())
    row[SAT] = float((absx >= overflow).sum())
    return row
