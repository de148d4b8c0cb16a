"""Capture statistics: the fused Triton pass vs the torch device path, against x.clone().

Each is timed in the same run on the same tensor (CUDA events around --inner calls on a GPU,
wall clock on the CPU); the table gives ms, the bandwidth of one read of the tensor, and the
ratio to clone (which reads and writes it once).

    python bench/bench_stats.py --device cuda
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from lowp_common import CommandParser, HelpWithDefaults

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _timer(fn, device: str, inner: int):
    """Seconds per call: CUDA events around ``inner`` calls (bench_quant's timer), or wall clock."""
    if device.startswith("cuda"):
        from bench_quant import _cuda_timer  # this folder is on sys.path when run as a script
        return _cuda_timer(fn, inner)

    def cpu_time():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return cpu_time


def main(argv=None) -> int:
    ap = CommandParser(description=__doc__.split("\n\n")[0],
                       formatter_class=HelpWithDefaults)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=10)
    args = ap.parse_args(argv)
    from tensor_capture import stats
    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0))
    x = x.to(args.device, DTYPES[args.dtype])
    ranges = [stats.format_range(f) for f in ("fp8_e4m3", "fp8_e5m2", "hifp8")]
    ranges.append(stats.dtype_range(torch.bfloat16))
    from quant.interpreter import triton_interpreting
    calls = {"x.clone()": lambda: x.clone(),
             "stats torch": lambda: stats.compute(x, ranges, host_path=False, kernel=False)}
    if x.is_cuda or triton_interpreting():     # the Triton pass: GPU, or the CPU interpreter
        calls["stats fused"] = lambda: stats.compute(x, ranges, kernel=True)
    if not args.device.startswith("cuda"):
        calls["stats host path"] = lambda: stats.compute(x, ranges, host_path=True, kernel=False)
    times = {k: [] for k in calls}
    for fn in calls.values():
        fn()
    for r in range(args.repeats):
        for k, fn in (list(calls.items()) if r % 2 == 0 else list(calls.items())[::-1]):
            times[k].append(_timer(fn, args.device, args.inner)())
    nbytes = x.numel() * x.element_size()
    print(f"{args.rows}x{args.cols} {args.dtype} on {args.device}, {len(ranges)} range specs")
    base = statistics.median(times["x.clone()"])
    print(f"{'what':<18}{'ms':>9}{'read GB/s':>11}{'vs clone':>10}")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:<18}{med * 1e3:>9.3f}{nbytes / med / 1e9:>11.1f}{base / med:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
