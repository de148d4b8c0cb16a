"""Whole-tensor statistics computed on the tensor's device, without a host sync.

Why a packed vector: the saver computes statistics where the tensor lives (GPU
during real training), copies one small float64 vector to the host together with
the tensor (non_blocking), and the background writer decodes it into the metadata
dict. Nothing here calls ``.item()``, so capture does not stall the device stream.

Layout of the vector (see :func:`decode`): the scalar block (``schema.STAT_KEYS``
order minus ``absmax``, which is derived), then 4 counts per range spec (upper
overflow, lower overflow, underflow, flush-to-zero), then the log2 histogram bins
for exponents ``HIST_MIN_EXP .. HIST_MAX_EXP``.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Sequence

import numpy as np
import torch

from quant import cbuild
from quant.analysis import CastLimits, cast_limits, dtype_limits
from quant.formats import SCALING_IDENTITY, SCALING_NONE, get_format
from quant.optional import OptionalModule

from . import schema
from .state import STATE

HIST_MIN_EXP = -1100   # covers float64 subnormals (2^-1074)
HIST_MAX_EXP = 1024
_HIST_BINS = HIST_MAX_EXP - HIST_MIN_EXP + 1
# Scalars in the packed vector, in this order.
_SCALARS = ("numel", "min", "max", "mean", "std", "min_nonzero_abs",
            "zero_count", "nan_count", "inf_count")
_RANGE_COUNTS = schema.STAT_RANGE_COUNT_KEYS


#: Thresholds of one number format: the one definition of overflow / underflow / flush to zero
#: lives in quant.analysis (CastLimits: max_normal, min_normal, min_subnormal and where the
#: format's rounding overflows and flushes); the counts below apply it exactly.
RangeSpec = CastLimits


def dtype_range(dtype: torch.dtype) -> RangeSpec | None:
    """Thresholds of a torch floating dtype (quant's table; float64 from finfo)."""
    return dtype_limits(dtype)


def is_scaled(fmt_name: str) -> bool:
    """True for formats with a block or tensor scale (MX, NVFP4, *_tensor)."""
    spec = _quant_spec(fmt_name)
    return spec is not None and spec.scaling not in (SCALING_NONE, SCALING_IDENTITY)


def format_range(fmt_name: str) -> RangeSpec | None:
    """Thresholds of an unscaled quant format; None for scaled formats, whose raw values are
    not compared with the element range (see the saver's quant analysis instead)."""
    if _quant_spec(fmt_name) is None or is_scaled(fmt_name):
        return None
    return cast_limits(fmt_name)


def _quant_spec(name: str) -> Any:
    try:
        return get_format(name)
    except (KeyError, ValueError):
        return None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def compute(x: torch.Tensor, ranges: Sequence[RangeSpec] = (), host_path: bool | None = None,
            kernel: bool | None = None, c_kernel: bool | None = None) -> torch.Tensor:
    """Packed statistics of ``x`` (any shape, any stride) as a float64 vector on x's device.

    Min/max/mean/std are over finite values; counts are exact. Decode with :func:`decode`.
    ``c_kernel`` (default: on for CPU tensors when the C kernel builds here; False: the torch
    paths) computes everything in two reads of the tensor (tensor_capture.stats_vector_c).
    ``host_path`` (default: on for CPU tensors) takes the torch CPU fast path, which may branch
    on values (free on the host) and avoids the slow CPU kernels (bincount over wide ranges,
    bucketize, boolean masks); it falls back to the general path for non-finite input.
    ``kernel`` (default: on for CUDA tensors when Triton imports) computes everything in one
    fused Triton pass (``stats_kernel``); True forces it (CPU tensors: Triton's interpreter).
    """
    if kernel is None:
        kernel = x.is_cuda and _stats_kernel() is not None
    if kernel and x.numel() and x.dtype != torch.float64:
        return _compute_kernel(x, ranges)
    if host_path is None:
        host_path = x.device.type == "cpu"
    if host_path and c_kernel is not False and x.device.type == "cpu":
        c = CPU_VECTOR_KERNEL.get()
        if c is None and c_kernel:
            raise RuntimeError(f"capture statistics with c_kernel=True need the C kernel: "
                               f"{CPU_VECTOR_KERNEL.error}")
        vec = c.vector(x, ranges) if c is not None else None
        if vec is not None:
            return vec
    if host_path:
        vec = _compute_host(x, ranges)
        if vec is not None:
            return vec
    return _compute_device(x, ranges)


def _load_cpu_vector_kernel() -> Any:
    """tensor_capture.stats_vector_c built for this vector's layout, checked on its probe
    against the device path (the definitions): counts, min, max, smallest nonzero and the
    histogram equal; mean and std, float64 sums in another order, within float64's bound."""
    from . import stats_vector_c

    try:
        kernel = stats_vector_c.load(_SCALARS, HIST_MIN_EXP, _HIST_BINS)
        _check_cpu_vector_kernel(kernel)
    except ImportError as exc:      # said once where a compiler exists (none: silently torch)
        if cbuild.compiler() is not None:
            print(f"tensor capture: {exc}; CPU statistics by torch (the same numbers, slower)",
                  file=sys.stderr, flush=True)
        raise
    return kernel


def _check_cpu_vector_kernel(kernel: Any) -> None:
    """Raise ImportError unless ``kernel`` agrees with the device path on its probe."""
    from . import stats_vector_c

    ranges = [cast_limits("fp8_e4m3"), cast_limits("hifp8"), dtype_limits(torch.bfloat16)]
    for dtype in stats_vector_c.DTYPE_CODES:
        probe = stats_vector_c.probe_values().to(dtype)
        got, want = kernel.vector(probe, ranges), _compute_device(probe, ranges)
        finite = probe[torch.isfinite(probe)].double()
        tol = probe.numel() * 2.0 ** -52 * float(finite.abs().sum() + (finite * finite).sum())
        moments = [_SCALARS.index("mean"), _SCALARS.index("std")]
        exact = [i for i in range(got.numel()) if i not in moments]
        if not (torch.equal(got[exact], want[exact])
                and bool(((got[moments] - want[moments]).abs() <= tol).all())):
            bad = (got != want).nonzero().reshape(-1)[:4].tolist()
            raise ImportError(f"the compiled capture statistics kernel {kernel.path} disagrees "
                              f"with the definitions on its probe ({dtype}, slots {bad})")


#: the C kernel of CPU tensors' vectors (tensor_capture.stats_vector_c), loaded on first use; its
#: outcome (the kernel, or the ImportError saying why not) is process state (a build per machine)
CPU_VECTOR_KERNEL = OptionalModule(_load_cpu_vector_kernel)


def fused_kernel_available() -> bool:
    """Whether the fused Triton pass (``stats_kernel``) imports here (CUDA tensors use it)."""
    return _stats_kernel() is not None


def _stats_kernel():
    """``tensor_capture.stats_kernel`` when Triton imports, else None (imported once per
    process: ``STATE.stats_kernel``, which a capture session's reset keeps)."""
    return STATE.stats_kernel.get()


def _compute_kernel(x: torch.Tensor, ranges: Sequence[RangeSpec]) -> torch.Tensor:
    """The packed vector from the fused Triton pass (bounds as float32 values, as the torch
    paths compare float32 / bf16 / fp16 input in float32)."""
    kernel = _stats_kernel()
    if kernel is None:
        raise RuntimeError("capture statistics with kernel=True need the triton package "
                           "(pip install triton)")
    ct = torch.float32
    bounds = [(r.overflow_bound(ct), r.underflow_bound(ct), r.flush_bound(ct)) for r in ranges]
    scalars, counts, f32_hist, min_exp = kernel.compute_parts(x.detach().reshape(-1), bounds)
    hist = torch.zeros(_HIST_BINS, dtype=torch.float64, device=x.device)
    lo = min_exp - HIST_MIN_EXP
    hist[lo: lo + f32_hist.numel()] = f32_hist
    return torch.cat([scalars, counts, hist] if ranges else [scalars, hist])


def _is_pow2(t: float) -> bool:
    return t > 0 and math.frexp(t)[0] == 0.5


def _compute_host(x: torch.Tensor, ranges: Sequence[RangeSpec]) -> torch.Tensor | None:
    """CPU path for all-finite tensors: few vectorized float passes, one small bincount."""
    ct = _compute_dtype(x)
    a = x.detach().reshape(-1)
    if a.dtype != ct:
        a = a.to(ct)
    n = a.numel()
    if n == 0:
        return None
    total = a.sum().double()              # pairwise float32 summation: ~1e-7 relative
    if not math.isfinite(total.item()):
        return None                       # NaN/Inf present (or a sum overflow): general path
    mn, mx = torch.aminmax(a)
    absmax = max(abs(mn.item()), abs(mx.item()))
    mean = total / n
    d = a - mean.to(ct)
    # squares of very large or very small values leave float32's range: scale first
    scale = absmax if ct == torch.float32 and absmax > 0 and not 1e-15 < absmax < 1e15 else 1.0
    if scale != 1.0:
        d = d / scale
    var = (d * d).sum().double() * (scale * scale) / max(n - 1, 1)
    std = var.sqrt() if n > 1 else torch.zeros((), dtype=torch.float64)
    absa = a.abs()
    itype, mbits, bias, nfield = _BITS[ct]
    field = absa.view(itype) >> mbits            # biased exponent: floor(log2|x|) + bias
    field_counts = torch.bincount(field, minlength=nfield)
    zero_count = 0
    if int(field_counts[0]):                     # zeros or subnormals present
        zero_count = n - int(torch.count_nonzero(a))
    if zero_count:
        # zeros -> absmax (finite, >= every nonzero |x|), so the minimum is the smallest nonzero
        min_nz = (absa + (1 - absa.sign()) * absmax).amin().item() if zero_count < n else math.inf
    else:
        min_nz = absa.amin().item()
    hist = _exp_hist(absa, field, field_counts, zero_count, bias)
    scalars = torch.tensor([float(n), mn.item(), mx.item(), mean.item(), std.item(), min_nz,
                            float(zero_count), 0.0, 0.0], dtype=torch.float64)
    parts = [scalars]
    if ranges:
        parts.append(_range_counts_host(a, absa, ranges, hist, mn.item(), mx.item(),
                                        zero_count, min_nz, ct))
    parts.append(hist.to(torch.float64))
    return torch.cat(parts)


# float dtype -> (same-width integer dtype, mantissa bits, exponent bias, exponent field size)
_BITS = {torch.float32: (torch.int32, 23, 127, 256), torch.float64: (torch.int64, 52, 1023, 2048)}


def _exp_hist(absa: torch.Tensor, field: torch.Tensor, field_counts: torch.Tensor,
              zero_count: int, bias: int) -> torch.Tensor:
    """Counts per floor(log2|x|) over HIST_MIN_EXP..HIST_MAX_EXP (zeros excluded).

    Exact and cheap: for normal numbers the biased exponent field of |x| (one shift of the
    bit pattern, counted by one small bincount) is floor(log2|x|) + bias. Subnormals
    (field 0, nonzero) are rare and binned exactly with frexp.
    """
    counts = field_counts.to(torch.int64)
    hist = torch.zeros(_HIST_BINS, dtype=torch.int64)
    lo = 1 - bias - HIST_MIN_EXP                       # hist index of field value 1
    hist[lo: lo + counts.numel() - 1] = counts[1:]
    if int(counts[0]) - zero_count:
        tiny = absa[(absa > 0) & (field == 0)]
        _, e = torch.frexp(tiny)
        hist += torch.bincount(e.to(torch.int64) - 1 - HIST_MIN_EXP, minlength=_HIST_BINS)[:_HIST_BINS]
    return hist


def _range_counts_host(a, absa, ranges, hist, mn, mx, zero_count, min_nz, ct) -> torch.Tensor:
    out: list[float] = []
    cum = None
    for spec in ranges:
        up = spec.overflow_bound(ct)              # |x| >= up overflows (all values finite here)
        out.append(float((a >= up).sum()) if mx >= up else 0.0)
        out.append(float((a <= -up).sum()) if mn <= -up else 0.0)
        for t in (spec.min_normal, spec.flush_bound(ct)):   # nonzero |x| < t
            if t <= 0 or min_nz >= t:             # nothing nonzero below t: no pass needed
                out.append(0.0)
            elif _is_pow2(t):
                k = math.frexp(t)[1] - 1          # |x| < 2^k  <=>  floor(log2|x|) < k
                if cum is None:
                    cum = torch.cumsum(hist, 0)
                j = k - HIST_MIN_EXP               # bins 0..j-1 hold exponents < k
                out.append(float(cum[j - 1]) if j > 0 else 0.0)
            else:
                out.append(float((absa < t).sum()) - zero_count)
    return torch.tensor(out, dtype=torch.float64)


def _compute_device(x: torch.Tensor, ranges: Sequence[RangeSpec]) -> torch.Tensor:
    """General path (any values, any device), no host synchronization."""
    dev = x.device
    ct = _compute_dtype(x)
    a = x.detach().reshape(-1)
    if a.dtype != ct:
        a = a.to(ct)
    n = a.numel()
    nr = len(ranges)
    if n == 0:
        out = torch.zeros(len(_SCALARS) + 4 * nr + _HIST_BINS, dtype=torch.float64, device=dev)
        out[1:6] = float("nan")
        return out
    finite = torch.isfinite(a)
    nf = finite.sum()
    nan_count = torch.isnan(a).sum()
    inf_count = n - nf - nan_count
    fa = torch.where(finite, a, 0.0)
    absf = fa.abs()
    inf_t = torch.tensor(math.inf, dtype=ct, device=dev)
    mn = torch.where(finite, a, inf_t).amin()
    mx = torch.where(finite, a, -inf_t).amax()
    total = fa.sum(dtype=torch.float64)
    nf64 = nf.to(torch.float64)
    mean = total / nf64
    dev_ = torch.where(finite, fa.double() - mean, 0.0)     # float64: squares stay in range
    var = (dev_ * dev_).sum() / (nf64 - 1).clamp_min(1)
    std = torch.where(nf64 > 1, var.sqrt(), torch.zeros_like(var))
    nonzero = absf > 0
    min_nz = torch.where(nonzero, absf, inf_t).amin()
    zero_fa = n - nonzero.sum()            # zeros plus the non-finite values zeroed above
    zero_count = zero_fa - (n - nf)
    scalars = torch.stack([
        torch.tensor(float(n), dtype=torch.float64, device=dev), mn.double(), mx.double(),
        mean, std, min_nz.double(), zero_count.double(), nan_count.double(), inf_count.double(),
    ])
    parts = [scalars]
    if nr:
        pos_inf = (a == math.inf).sum()
        parts.append(_range_counts(fa, ranges, zero_fa, ct, pos_inf, inf_count - pos_inf))
    _, exp = torch.frexp(absf)                       # |x| = m * 2^e, m in [0.5, 1)
    idx = torch.where(nonzero, exp.to(torch.int64) - 1 - HIST_MIN_EXP + 1, 0)
    hist = torch.bincount(idx, minlength=_HIST_BINS + 1)[1:_HIST_BINS + 1]
    parts.append(hist.to(torch.float64))
    return torch.cat(parts)


def _range_counts(fa: torch.Tensor, ranges: Sequence[RangeSpec], zero_fa: torch.Tensor,
                  ct: torch.dtype, pos_inf: torch.Tensor, neg_inf: torch.Tensor) -> torch.Tensor:
    """Overflow/underflow counts for every spec with one bucketize and one bincount.

    The comparisons (x >= up, x <= -up, 0 < |x| < t) become half-open buckets
    ``b[k-1] <= x < b[k]`` with bounds that are values of the compute dtype; a bound the dtype
    cannot reach is decided analytically. ``fa`` has its non-finite values zeroed: +-Inf
    (``pos_inf`` / ``neg_inf``) are added to the upper / lower overflow.
    """
    fi = torch.finfo(ct)
    smallest = fi.tiny * fi.eps
    dev = fa.device
    bounds: list[float] = []
    plan: list[list[Any]] = []

    def add(value: float) -> int:
        bounds.append(value)
        return len(bounds) - 1

    for spec in ranges:
        entry: list[Any] = []
        up = spec.overflow_bound(ct)                               # overflow: x >= up
        if math.isfinite(up):
            entry.append(add(up))
            entry.append(add(_step(-up, math.inf, ct)))            # x <= -up <=> x < next(-up)
        else:
            entry.extend([None, None])
        for te in (spec.underflow_bound(ct), spec.flush_bound(ct)):  # 0 < |x| < te
            if te <= smallest:
                entry.append(None)                                 # 0 < |x| < te impossible
                continue
            entry.append((add(_step(-te, 0.0, ct)), add(te)))      # -te < x < te
        plan.append(entry)
    order = sorted(range(len(bounds)), key=lambda i: bounds[i])
    pos = {orig: k for k, orig in enumerate(order)}
    if bounds:
        b = torch.tensor([bounds[i] for i in order], dtype=ct, device=dev)
        idx = torch.bucketize(fa, b, right=True)                   # b[k-1] <= x < b[k] -> k
        cum = torch.bincount(idx, minlength=len(bounds) + 1).cumsum(0)  # cum[k] = #(x < b[k])
    n = fa.numel()
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    out = []
    for upper, lower, normal_pair, ftz_pair in plan:
        out.append((n - cum[pos[upper]] if upper is not None else zero) + pos_inf)
        out.append((cum[pos[lower]] if lower is not None else zero) + neg_inf)
        for pair in (normal_pair, ftz_pair):
            out.append(zero if pair is None else cum[pos[pair[1]]] - cum[pos[pair[0]]] - zero_fa)
    return torch.stack([o.to(torch.float64) for o in out])


def _step(v: float, toward: float, ct: torch.dtype) -> float:
    return torch.nextafter(torch.tensor(v, dtype=ct), torch.tensor(toward, dtype=ct)).item()


def decode(vec: torch.Tensor | Sequence[float], ranges: Sequence[RangeSpec] = ()) -> dict[str, Any]:
    """The metadata ``stats`` dict (keys per schema.STAT_KEYS, STAT_RANGE, STAT_LOG2_HIST).

    Only the histogram's nonzero span leaves the tensor (its 2,125 bins as Python numbers cost
    ~150 us per record, more than computing the statistics of a small tensor)."""
    # a numpy view: slicing and nonzero on it cost a tenth of torch's per call (a record each)
    packed = (vec.detach().reshape(-1).cpu().double().numpy() if isinstance(vec, torch.Tensor)
              else np.asarray(list(vec), dtype=np.float64))
    base = len(_SCALARS) + 4 * len(ranges)
    v = packed[:base].tolist()
    s = dict(zip(_SCALARS, v[:len(_SCALARS)]))
    out: dict[str, Any] = {}
    for key in schema.STAT_KEYS:
        if key == "absmax":
            lo, hi = s["min"], s["max"]
            out[key] = max(abs(lo), abs(hi)) if not (math.isnan(lo) or math.isinf(lo)) else (
                float("nan") if s["numel"] == 0 or math.isnan(lo) else 0.0)
        elif key in schema.STAT_COUNT_KEYS:
            out[key] = int(s[key])
        else:
            out[key] = s[key]
    n = max(int(s["numel"]), 1)
    if out["min_nonzero_abs"] == math.inf:
        out["min_nonzero_abs"] = None
    if s["min"] == math.inf:         # no finite value at all
        out["min"] = out["max"] = out["absmax"] = None
    rng: dict[str, Any] = {}
    for i, spec in enumerate(ranges):
        c = [int(x) for x in v[len(_SCALARS) + 4 * i: len(_SCALARS) + 4 * i + 4]]
        rec = dict(zip(_RANGE_COUNTS, c))
        rec["overflow_count"] = rec["upper_overflow_count"] + rec["lower_overflow_count"]
        for k in list(rec):
            rec[k.replace("_count", "_ratio")] = rec[k] / n
        rec["max_normal"] = spec.max_normal
        rec["min_normal"] = spec.min_normal
        rec["min_subnormal"] = spec.min_subnormal
        rng[spec.name] = rec
    out[schema.STAT_RANGE] = rng
    nz = np.flatnonzero(packed[base:])
    if nz.size:
        first, last = int(nz[0]), int(nz[-1])
        counts = packed[base + first: base + last + 1].astype(np.int64).tolist()
        out[schema.STAT_LOG2_HIST] = {"min_exp": HIST_MIN_EXP + first, "counts": counts}
    else:
        out[schema.STAT_LOG2_HIST] = {"min_exp": 0, "counts": []}
    return out


def tensor_stats(x: torch.Tensor, ranges: Sequence[RangeSpec] = ()) -> dict[str, Any]:
    """Convenience: compute and decode at once (syncs; for tests and offline tools)."""
    return decode(compute(x, ranges).cpu(), ranges)
