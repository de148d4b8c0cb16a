#!/usr/bin/env python
"""Throughput of quant.quantize relative to x.clone() of the same tensor, in the same run.

clone() reads and writes the tensor once: the memory floor any out-of-place quantizer pays.
A ratio of 0.5 means quantize runs at half of clone's throughput. Clone and quantize runs are
interleaved and each ratio is median(clone) / median(quantize) over the same period.

``--clock cpu`` (with ``--threads 1``) times each run by the calling thread's CPU time instead of
the wall clock: on a shared machine the time the process waits for a core is left out (every
single-threaded kernel, clone's copy included, runs in the calling thread; page faults are the
thread's system time and count).

On CUDA each timed run is a CUDA-event-timed loop of --inner calls, and the table adds the
achieved bandwidth (the input read once + the output written once, per second) as a fraction
of the device's peak memory bandwidth (from NVML: memory clock x bus width x 2, or --peak-gbps).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from lowp_common import CommandParser

DEFAULT_FORMATS = ("mxfp8", "mxfp4", "nvfp4", "hifp8", "fp8_e4m3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: --clock -> the clock a CPU run is timed by
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _time(fn, repeats: int, clock=time.perf_counter) -> float:
    """Median seconds of fn() over ``repeats`` runs (after the caller's warm-up)."""
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def peak_bandwidth_gbps(device: str) -> float | None:
    """The device's peak memory bandwidth in GB/s from NVML (None when NVML cannot tell)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        index = torch.device(device).index or 0
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        return 2 * mhz * 1e6 * bus_bits / 8 / 1e9       # double data rate
    except Exception:  # no NVML, no permission, old driver: the caller says "unknown"
        return None


def _cuda_timer(fn, inner: int):
    """Seconds per call of fn, from CUDA events around ``inner`` back-to-back calls."""
    def timed():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    return timed


def _until_compiled(q, compile_mode: str, accel) -> float:
    """auto mode: call q as a training loop would until its kernel is hot, then wait for the
    background compile to take over; seconds that took (a user's eager phase plus the compile,
    on the machine's cores shared with it). The timed calls then measure the steady state."""
    if compile_mode != "auto":
        return 0.0
    t0 = time.perf_counter()
    for _ in range(accel.hot_after()):
        q()
    accel.wait_for_background()
    return time.perf_counter() - t0


def run(formats, rows: int, cols: int, repeats: int, warmup: int, compile_mode: str,
        device: str, dtype: torch.dtype = torch.float32, backend: str = "auto",
        inner: int = 20, clock: str = "wall") -> list[dict]:
    import os
    os.environ["QUANT_COMPILE"] = compile_mode
    import quant
    from quant import accel

    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def clone_once():
        x.clone()

    def clone():
        clone_once()
        sync()

    if x.is_cuda:
        clone = _cuda_timer(clone_once, inner)

    for _ in range(warmup):
        clone()
    results = []
    nbytes = x.numel() * x.element_size()
    clone_times = []
    for name in formats:
        quant.get_format(name)  # clear error for a bad name before any timing

        def q_once(name=name):
            quant.quantize(x, name, backend=backend)

        def q(name=name):
            q_once(name)
            sync()

        t_first = time.perf_counter()
        q()
        first = time.perf_counter() - t_first
        ready = _until_compiled(q, compile_mode, accel) if not x.is_cuda else 0.0
        for _ in range(warmup):
            q()
        # interleave clone and quantize so load changes on a shared machine hit both alike
        tc, tq = [], []
        for _ in range(repeats):
            if x.is_cuda:
                tc.append(clone())
                tq.append(_cuda_timer(q_once, inner)())
            else:
                tc.append(_time(clone, 1, CLOCKS[clock]))
                tq.append(_time(q, 1, CLOCKS[clock]))
        t_c, t_q = statistics.median(tc), statistics.median(tq)
        clone_times += tc
        # formats with a per-tensor scale read x twice (the amax pass, then the cast)
        reads = 2 if quant.get_format(name).scaling in ("nvfp4", "tensor") else 1
        results.append({"format": name, "seconds": t_q, "first_call_s": first,
                        "ready_s": ready,
                        "gb_per_s": 2 * nbytes / t_q / 1e9,
                        "traffic_gb_per_s": (reads + 1) * nbytes / t_q / 1e9,
                        "clone_seconds": t_c,
                        "ratio_to_clone": t_c / t_q})
    t_clone = statistics.median(clone_times) if clone_times else (
        clone() if x.is_cuda else _time(clone, repeats, CLOCKS[clock]))
    for r in results:
        # The conservative ratio: against clone's median over the whole run, not only the
        # runs interleaved with this format (clone right after a quantize can be slower).
        r["ratio_to_clone_overall"] = t_clone / r["seconds"]
    results.insert(0, {"format": "x.clone()", "seconds": t_clone, "first_call_s": 0.0,
                       "ready_s": 0.0,
                       "gb_per_s": 2 * nbytes / t_clone / 1e9,
                       "traffic_gb_per_s": 2 * nbytes / t_clone / 1e9, "clone_seconds": t_clone,
                       "ratio_to_clone": 1.0, "ratio_to_clone_overall": 1.0})
    err = accel.compile_error()
    if err is not None:
        print(f"note: torch.compile failed ({type(err).__name__}); eager kernels were timed",
              file=sys.stderr)
    return results


def main(argv=None) -> int:
    ap = CommandParser(description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS),
                    help="format names (default: %(default)s)")
    ap.add_argument("--rows", type=int, default=4096, help="tensor rows (default 4096)")
    ap.add_argument("--cols", type=int, default=4096, help="tensor columns (default 4096)")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per format (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs after the first call")
    ap.add_argument("--compile", choices=["auto", "1", "0"], default="auto",
                    help="QUANT_COMPILE mode: auto (large tensors), 1 always, 0 eager only")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="input dtype (default float32)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="CPU: wall clock, or the calling thread's CPU time (cpu: needs "
                         "--threads 1; a shared machine's waits for a core left out)")
    ap.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto",
                    help="quantization kernels (default auto: Triton for CUDA tensors)")
    ap.add_argument("--inner", type=int, default=20,
                    help="CUDA: calls per event-timed run (default 20)")
    ap.add_argument("--peak-gbps", type=float, default=None,
                    help="CUDA: the device's peak memory bandwidth in GB/s (default: from NVML)")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.cols < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error("--rows/--cols/--repeats must be >= 1 and --warmup >= 0")
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (it times the calling thread only)")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        results = run(args.formats, args.rows, args.cols, args.repeats, args.warmup,
                      args.compile, args.device, DTYPES[args.dtype], args.backend,
                      max(args.inner, 1), args.clock)
    except (ValueError, RuntimeError) as exc:
        print(f"bench_quant: {exc}", file=sys.stderr)
        return 2
    cuda = torch.device(args.device).type == "cuda"
    peak = (args.peak_gbps or peak_bandwidth_gbps(args.device)) if cuda else None
    where = torch.cuda.get_device_name(args.device) if cuda else (
        f"{torch.get_num_threads()} threads")
    print(f"quantize throughput on a {args.rows}x{args.cols} {args.dtype} tensor, device "
          f"{args.device} ({where}), backend={args.backend}, compile={args.compile}, "
          f"median of {args.repeats}, clock={args.clock}")
    if cuda:
        print(f"peak memory bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown (--peak-gbps)'}"
              f"; GB/s = (x read once + y written once) / time")
    print("vs clone: clone ms (timed interleaved with that format) / quantize ms; "
          "vs clone (all): clone's median over the whole run / quantize ms")
    print("compiled after s (compile=auto): the calls a user makes until the kernel is hot plus "
          "its background compile; the timed calls run the compiled kernel")
    print("traffic: the bytes really moved (nvfp4 and *_tensor read x twice: amax pass + cast)")
    print(f"{'format':<12} {'ms':>9} {'GB/s':>8} {'of peak':>8} {'traffic':>8} {'of peak':>8} "
          f"{'clone ms':>9} {'vs clone':>9} {'vs clone (all)':>15} {'first call s':>13} "
          f"{'compiled after s':>17}")
    for r in results:
        frac = f"{r['gb_per_s'] / peak:8.1%}" if peak else f"{'-':>8}"
        tfrac = f"{r['traffic_gb_per_s'] / peak:8.1%}" if peak else f"{'-':>8}"
        print(f"{r['format']:<12} {r['seconds'] * 1e3:9.3f} {r['gb_per_s']:8.1f} {frac} "
              f"{r['traffic_gb_per_s']:8.1f} {tfrac} "
              f"{r['clone_seconds'] * 1e3:9.3f} {r['ratio_to_clone']:9.3f} "
              f"{r['ratio_to_clone_overall']:15.3f} {r['first_call_s']:13.2f} "
              f"{r['ready_s']:17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
