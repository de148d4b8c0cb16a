"""Benchmark: the batched MXFP scale sweep against a level-by-level loop, in the same run.

Batched: ``quant.scaling_sweep.run_sweep`` (all levels per cache-sized tile, one pass over the
tensor, analyses included, no plots). Baseline: what a straightforward tool does per level:
``quant.quantize(x / f, fmt) * f``, the seven ``quant.metrics`` and
``quant.analyze_quantization``. The baseline's first call is a warm-up (quant may compile its
kernels on large tensors) and is not timed. With ``--baseline-levels k < levels`` the baseline
is timed on k levels and scaled to all levels (said in the output).

    python bench/bench_scaling.py                      # 4096 x 4096 bf16, 21 levels, fp8_e4m3
    python bench/bench_scaling.py --size 1024 --baseline-levels 21
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import quant
from lowp_common import CommandParser
from quant import scaling_sweep as ss

METRICS = (quant.metrics.mse, quant.metrics.rmse, quant.metrics.cosine_similarity,
           quant.metrics.psnr, quant.metrics.mae, quant.metrics.max_abs_error,
           quant.metrics.relative_error)


def baseline_level(x: torch.Tensor, f: torch.Tensor, fmt: str) -> dict:
    v = x / f
    q = quant.quantize(v, fmt)
    deq = q * f
    out = {fn.__name__: fn(x, deq) for fn in METRICS}
    a = quant.analyze_quantization(v, fmt, quantized=q)
    out.update(overflow=a.overflow_count, underflow=a.underflow_count,
               flush=a.flush_to_zero_count)
    return out


def main(argv=None) -> int:
    p = CommandParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096, help="tensor is SIZE x SIZE (default 4096)")
    p.add_argument("--levels", type=int, default=21, help="scale levels (default 21)")
    p.add_argument("--format", default="fp8_e4m3", choices=ss.ELEMENT_FORMATS)
    p.add_argument("--baseline-levels", type=int, default=3,
                   help="levels the baseline loop actually runs (default 3, scaled to --levels)")
    p.add_argument("--repeat", type=int, default=2, help="batched runs; the best is reported")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(args.size, args.size, generator=g) * 0.02).to(torch.bfloat16)
    print(f"tensor {args.size}x{args.size} bf16 ({x.numel() / 1e6:.1f} M elements), "
          f"{args.levels} levels, {args.format}, torch threads {torch.get_num_threads()}")

    ss.run_sweep(x[:64], args.format, num_levels=args.levels)     # import / first-call warm-up
    best = float("inf")
    res = None
    for _ in range(max(1, args.repeat)):
        t0 = time.perf_counter()
        res = ss.run_sweep(x, args.format, num_levels=args.levels)
        best = min(best, time.perf_counter() - t0)
    print(f"batched sweep (run_sweep, no plots): {best:.2f} s "
          f"({x.numel() * args.levels / best / 1e6:.0f} M element-levels/s)  "
          f"target <= 5 s: {'met' if best <= 5.0 else 'NOT met'}")

    xf = x.float().reshape(-1)
    factors = ss.scale_factors(res.plan.levels)
    k = max(1, min(args.baseline_levels, len(factors)))
    picks = torch.linspace(0, len(factors) - 1, k).round().long().tolist()
    baseline_level(xf, factors[picks[0]], args.format)                 # warm-up, not timed
    t0 = time.perf_counter()
    for i in picks:
        ref = baseline_level(xf, factors[i], args.format)
        lv = res.levels[i]
        assert ref["overflow"] == lv.overflow_count and ref["flush"] == lv.flush_to_zero_count
        assert abs(ref["mse"] - lv.metrics["mse"]) <= 1e-5 * abs(ref["mse"]) + 1e-30
    per_level = (time.perf_counter() - t0) / k
    loop = per_level * len(factors)
    how = "measured" if k == len(factors) else f"{k} levels measured, scaled to {len(factors)}"
    print(f"level-by-level loop (quantize + metrics + analyze): {loop:.2f} s ({how}; "
          f"{per_level:.2f} s per level)")
    print(f"speed-up batched vs loop: {loop / best:.1f}x (results agree on the measured levels)")

    # the same kernels, one level per pass: what the [levels, chunk] tiles save by themselves
    prep = ss.prepare_tensor(x)
    t0 = time.perf_counter()
    for i in range(len(factors)):
        ss.accumulate_stats(prep.values, factors[i:i + 1], res.grid)
    same = time.perf_counter() - t0
    print(f"same kernels one level per pass: {same:.2f} s; batched tiles are "
          f"{same / best:.1f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
