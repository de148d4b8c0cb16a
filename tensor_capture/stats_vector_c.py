"""A capture's packed statistics of a CPU tensor (tensor_capture.stats' vector) by a C kernel.

Why C: the torch host path makes a dozen passes over the tensor and as many Python calls
(sum, aminmax, the deviations, abs, the exponent field's bincount, a count per bound), about a
millisecond per tensor at a small model's widths, where a step captures a few hundred tensors:
stats-only capture cost 2.3x the step at hidden 128. This kernel reads each element twice: a
first pass for everything but the spread (the exponent-field histogram in four interleaved
tables, counts, min / max, smallest nonzero magnitude and the sum in float64 lanes), a second
for the sum of squared deviations from the mean, in float64 as the device path does.

What equals which: counts (zeros, NaN, Inf, every range count), min, max, the smallest nonzero
magnitude and the log2 histogram equal the torch paths exactly; the mean and the standard
deviation are float64 sums in another order (within float64's summation bound of the exact
value; the torch host path sums in float32, the device path in float64). float32, bfloat16 and
float16 are read (the 16-bit ones widened exactly, as the torch paths widen them to float32);
float64 and empty tensors stay with torch. Built once per machine by quant.cbuild and checked
against the definitions on a probe; where that fails the torch paths run (same numbers).
"""
from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path
from typing import Sequence

import torch

from quant import cbuild
from quant.analysis import CastLimits

#: torch dtype -> the kernel's element code
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: range specs the kernel counts at once (more: the torch path)
MAX_RANGES = 16

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

/* Layout of out (tensor_capture.stats): N_SCALARS scalars, each at its S_<NAME> (numel, min,
   max, mean, std, min_nonzero_abs, zero, nan, inf counts), 4 counts per range (x >= up,
   x <= -up, 0 < |x| < underflow bound, 0 < |x| < flush bound), then HIST_BINS counts of
   floor(log2|x|) from HIST_MIN_EXP. Every one of these macros comes from Python (the order of
   tensor_capture.stats' _SCALARS), as does MAX_RANGES. */
#define LANES 16
#define CHUNK 2048

/* each pass over a chunk is its own function, never inlined (inlined, the compiler vectorized
   the loop over ranges instead of the one over elements), built for AVX-512, AVX2 and the
   baseline on x86-64 and picked for the CPU at load */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(LOWP_NO_CLONES)
#define PASS __attribute__((noinline, target_clones("avx512f", "avx2", "default"))) static
#elif defined(__GNUC__)
#define PASS __attribute__((noinline)) static
#else
#define PASS static
#endif

static inline float widen_bf16(uint16_t h) {
    uint32_t b = (uint32_t)h << 16; float v; memcpy(&v, &b, sizeof v); return v;
}
static inline float widen_f16(uint16_t h) {
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31u, m = h & 1023u, b;
    float v;
    if (e == 0) { v = (float)m * 0x1p-24f; return s ? -v : v; }     /* zero, subnormal: exact */
    b = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112u) << 23) | (m << 13));
    memcpy(&v, &b, sizeof v);
    return v;
}

/* chunk k of the input as float32 (a pointer into x for float32, else widened into buf) */
static const float *chunk_of(const void *x, int code, int64_t k, int64_t m, float *buf) {
    if (code == 0) return (const float *)x + k;
    const uint16_t *h = (const uint16_t *)x + k;
    if (code == 1) for (int64_t i = 0; i < m; i++) buf[i] = widen_bf16(h[i]);
    else for (int64_t i = 0; i < m; i++) buf[i] = widen_f16(h[i]);
    return buf;
}

typedef struct { double s[LANES]; float lo[LANES], hi[LANES], nz[LANES];
                 int64_t zero, nan, inf; } moments_t;

/* the first pass over one chunk: finite sum (float64 lanes), min, max, smallest nonzero |x|,
   zero / NaN / Inf counts; lanes combine in a fixed order at the end. Returns the chunk's
   zeros. */
PASS int64_t moments(const float *v, int64_t m, moments_t *M) {
    double s[LANES];
    float lo[LANES], hi[LANES], nz[LANES];
    int32_t cz[LANES] = {0}, cn[LANES] = {0}, ci[LANES] = {0};
    memcpy(s, M->s, sizeof s); memcpy(lo, M->lo, sizeof lo);
    memcpy(hi, M->hi, sizeof hi); memcpy(nz, M->nz, sizeof nz);
    int64_t i = 0;
#define MOMENT(j, x) do { float a_ = fabsf(x); int fin_ = a_ < INFINITY;                       \
        s[j] += fin_ ? (double)(x) : 0.0;                                                      \
        float l_ = fin_ ? (x) : INFINITY, h_ = fin_ ? (x) : -INFINITY;                         \
        float z_ = (fin_ & (a_ > 0.0f)) ? a_ : INFINITY;                                       \
        lo[j] = l_ < lo[j] ? l_ : lo[j]; hi[j] = h_ > hi[j] ? h_ : hi[j];                      \
        nz[j] = z_ < nz[j] ? z_ : nz[j];                                                       \
        cz[j] += a_ == 0.0f; cn[j] += (x) != (x); ci[j] += a_ == INFINITY; } while (0)
    for (; i + LANES <= m; i += LANES)
        for (int j = 0; j < LANES; j++) MOMENT(j, v[i + j]);
    for (int j = 0; i < m; i++, j++) MOMENT(j, v[i]);
    memcpy(M->s, s, sizeof s); memcpy(M->lo, lo, sizeof lo);
    memcpy(M->hi, hi, sizeof hi); memcpy(M->nz, nz, sizeof nz);
    int64_t zeros = 0;
    for (int j = 0; j < LANES; j++) { zeros += cz[j]; M->nan += cn[j]; M->inf += ci[j]; }
    M->zero += zeros;
    return zeros;
}

/* one range's four counts over a chunk (bounds as float32 values: comparisons in float32) */
PASS void range_counts(const float *v, int64_t m, const float *b, int64_t *c) {
    const float up = b[0], ub = b[1], fb = b[2];
    int32_t cu = 0, cl = 0, cs = 0, cf = 0;
    for (int64_t i = 0; i < m; i++) {
        float x = v[i], a = fabsf(x);
        int pos = a > 0.0f;
        cu += x >= up; cl += x <= -up; cs += pos & (a < ub); cf += pos & (a < fb);
    }
    c[0] += cu; c[1] += cl; c[2] += cs; c[3] += cf;
}

/* exponent fields in four tables (a run of equal fields does not wait on one counter); when
   field 0 holds more than the chunk's zeros, each subnormal's floor(log2|x|) from its
   mantissa's top bit */
PASS void fields(const float *v, int64_t m, int64_t zeros, uint32_t (*t)[256], int64_t *sub) {
    int64_t i = 0;
    uint32_t b;
    for (; i + 4 <= m; i += 4)
        for (int j = 0; j < 4; j++) { memcpy(&b, v + i + j, 4); t[j][(b >> 23) & 255u]++; }
    for (; i < m; i++) { memcpy(&b, v + i, 4); t[0][(b >> 23) & 255u]++; }
    if ((int64_t)t[0][0] + t[1][0] + t[2][0] + t[3][0] == zeros) return;
    for (i = 0; i < m; i++) {
        memcpy(&b, v + i, 4);
        uint32_t man = b & 0x7fffffu;
        if (((b >> 23) & 255u) == 0 && man) sub[31 - __builtin_clz(man)]++;
    }
}

/* the second pass: sum of squared deviations of the finite values, in float64 lanes */
PASS void deviations(const float *v, int64_t m, double mean, double *q) {
    int64_t i = 0;
    for (; i + LANES <= m; i += LANES)
        for (int j = 0; j < LANES; j++) {
            float x = v[i + j];
            double d = fabsf(x) < INFINITY ? (double)x - mean : 0.0;
            q[j] += d * d;
        }
    for (int j = 0; i < m; i++, j++) {
        float x = v[i];
        double d = fabsf(x) < INFINITY ? (double)x - mean : 0.0;
        q[j] += d * d;
    }
}

/* The packed vector of the n > 0 contiguous elements at x (code: 0 float32, 1 bfloat16,
   2 float16) judged against nr <= MAX_RANGES ranges (bounds: 3 float32 values each: overflow,
   underflow and flush bounds) into out. Returns 0, or -1 for a bad code, n or nr. */
int lowp_capture_stats(const void *x, int64_t n, int code, int nr, const float *bounds,
                       double *out) {
    if (code < 0 || code > 2 || n <= 0 || nr < 0 || nr > MAX_RANGES) return -1;
    uint32_t t[4][256];
    float buf[CHUNK];
    int64_t cnt[4 * MAX_RANGES] = {0}, sub[32] = {0}, field[256] = {0};
    moments_t M;
    memset(&M, 0, sizeof M);
    for (int j = 0; j < LANES; j++) { M.lo[j] = M.nz[j] = INFINITY; M.hi[j] = -INFINITY; }
    for (int64_t k = 0; k < n; k += CHUNK) {
        int64_t m = n - k < CHUNK ? n - k : CHUNK;
        const float *v = chunk_of(x, code, k, m, buf);
        memset(t, 0, sizeof t);          /* uint32 tables per chunk: no counter can wrap */
        int64_t zeros = moments(v, m, &M);
        for (int r = 0; r < nr; r++) range_counts(v, m, bounds + 3 * r, cnt + 4 * r);
        fields(v, m, zeros, t, sub);
        for (int f = 0; f < 256; f++) field[f] += (int64_t)t[0][f] + t[1][f] + t[2][f] + t[3][f];
    }
    double s = 0.0;
    float lo = INFINITY, hi = -INFINITY, nz = INFINITY;
    for (int j = 0; j < LANES; j++) {
        s += M.s[j];
        lo = M.lo[j] < lo ? M.lo[j] : lo; hi = M.hi[j] > hi ? M.hi[j] : hi;
        nz = M.nz[j] < nz ? M.nz[j] : nz;
    }
    int64_t nf = n - M.nan - M.inf;
    double mean = s / (double)nf, q[LANES] = {0}, var = 0.0;
    if (nf > 1) {
        for (int64_t k = 0; k < n; k += CHUNK) {
            int64_t m = n - k < CHUNK ? n - k : CHUNK;
            deviations(chunk_of(x, code, k, m, buf), m, mean, q);
        }
        for (int j = 0; j < LANES; j++) var += q[j];
        var /= (double)(nf - 1);
    }
    out[S_NUMEL] = (double)n; out[S_MIN] = lo; out[S_MAX] = hi; out[S_MEAN] = mean;
    out[S_STD] = nf > 1 ? sqrt(var) : 0.0; out[S_MIN_NONZERO_ABS] = nz;
    out[S_ZERO_COUNT] = (double)M.zero; out[S_NAN_COUNT] = (double)M.nan;
    out[S_INF_COUNT] = (double)M.inf;
    double *c = out + N_SCALARS, *h = c + 4 * nr;
    for (int r = 0; r < 4 * nr; r++) c[r] = (double)cnt[r];
    memset(h, 0, sizeof(double) * HIST_BINS);
    for (int f = 1; f < 255; f++) h[f - 127 - HIST_MIN_EXP] = (double)field[f];
    for (int b = 0; b < 23; b++) h[b - 149 - HIST_MIN_EXP] = (double)sub[b];
    return 0;
}
"""


class CaptureStatsKernel:
    """The loaded library: :meth:`vector` is tensor_capture.stats' packed vector of a CPU
    tensor, or None for one the kernel does not read (the caller's torch path)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, scalars: int, hist_bins: int) -> None:
        self.path = path
        self._fn = lib.lowp_capture_stats
        self._fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                             ctypes.c_void_p, ctypes.c_void_p)
        self._fn.restype = ctypes.c_int
        self._scalars, self._bins = scalars, hist_bins

    def vector(self, x: torch.Tensor, ranges: Sequence[CastLimits]) -> torch.Tensor | None:
        code = DTYPE_CODES.get(x.dtype)
        n = x.numel()
        if code is None or n == 0 or len(ranges) > MAX_RANGES or x.is_cuda:
            return None
        a = x.detach()
        if not a.is_contiguous():
            a = a.contiguous()
        bnd = _bounds(tuple(ranges))
        out = torch.empty(self._scalars + 4 * len(ranges) + self._bins, dtype=torch.float64)
        self._fn(a.data_ptr(), n, code, len(ranges), ctypes.addressof(bnd) if ranges else None,
                 out.data_ptr())
        return out


@functools.lru_cache(maxsize=256)
def _bounds(ranges: tuple[CastLimits, ...]) -> ctypes.Array:
    """The ranges' float32 bounds as the kernel reads them (computed once per set of specs:
    each bound is a few torch calls)."""
    f32 = torch.float32
    values = [b for r in ranges for b in (r.overflow_bound(f32), r.underflow_bound(f32),
                                          r.flush_bound(f32))]
    return (ctypes.c_float * max(len(values), 1))(*values)


#: the scalars the kernel writes, each at the place its name has in the caller's layout
SCALARS = ("numel", "min", "max", "mean", "std", "min_nonzero_abs", "zero_count", "nan_count",
           "inf_count")


def load(scalars: Sequence[str], hist_min_exp: int, hist_bins: int) -> CaptureStatsKernel:
    """Compile (once per machine: quant.cbuild's cache) and load the kernel for the vector
    layout given (tensor_capture.stats' scalar names in their order, and its histogram); the
    caller checks it on :func:`probe_values`. Raises ImportError naming what failed."""
    if sorted(scalars) != sorted(SCALARS):
        raise ImportError(f"the capture statistics kernel writes {SCALARS}, not {tuple(scalars)}")
    flags = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno",
             "-fno-trapping-math", f"-DN_SCALARS={len(scalars)}",
             *(f"-DS_{name.upper()}={i}" for i, name in enumerate(scalars)),
             f"-DHIST_MIN_EXP={hist_min_exp}", f"-DHIST_BINS={hist_bins}",
             f"-DMAX_RANGES={MAX_RANGES}")
    try:
        path = cbuild.build("capture_stats", _SOURCE, flags, ((), ("-DLOWP_NO_CLONES",)))
        kernel = CaptureStatsKernel(ctypes.CDLL(str(path)), path, len(scalars), hist_bins)
    except OSError as exc:
        raise ImportError(f"the capture statistics kernel could not be built or loaded: "
                          f"{exc}") from exc
    return kernel


def probe_values() -> torch.Tensor:
    """Values whose every statistic is exact in any order of summation (small integers and
    powers of two, each with its negative: the mean is 0, each squared deviation exact), with
    zeros, float32 subnormals, NaN and +-Inf, over several chunks and a tail: the load check's
    input."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (3 * 2048 + 37,), generator=g).float()
    x[9], x[13], x[17], x[19] = 3 * 2.0 ** -140, 2.0 ** -149, 1024.0, 2.0 ** -12
    specials = torch.tensor([math.nan, math.inf, -math.inf, math.nan])
    return torch.cat([x, specials, -x.flip(0)])
