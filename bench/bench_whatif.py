"""CPU time of one training step's what-if numerics: the default five formats format by format
(quant.whatif.whatif each; eager, and with quant.accel's compiled quantizers, QUANT_COMPILE=1)
against all five in one pass (quant.whatif_onepass), interleaved in one process, on Gaussian
tensors of the (sampled) shapes one step of bench_capture's model hands to the writer (2 layers,
hidden 512, 1024 tokens: 81 tensors, shapes below).

Why CPU time of the writer's work rather than step time: on a shared machine the step time
scatters by more than the what-if share; the thread's CPU seconds are what the what-if numbers
take from training (bench_capture.py measures the step itself).

    python bench/bench_whatif.py [--rounds 5]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from lowp_common import CommandParser, HelpWithDefaults

#: (shape, axis, count) of the what-if inputs of one step of bench_capture's default model
STEP_TENSORS = [((8, 4, 512), -1, 26), ((32, 512), -1, 14), ((4, 4, 1024), -1, 6),
                ((16, 4, 4, 64), -1, 6), ((8, 4, 8, 64), -1, 4), ((1, 4, 2720), -1, 4),
                ((3, 4, 1360), -1, 4), ((12, 1360), -1, 4), ((512, 32), 0, 4),
                ((1024, 16), 0, 3), ((256, 4, 4, 4), 0, 2), ((2, 32, 256), -1, 2),
                ((1360, 12), 0, 2)]


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(description=__doc__.split("\n\n")[0],
                       formatter_class=HelpWithDefaults)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from quant import accel
    from quant.whatif import DEFAULT_WHATIF_FORMATS, whatif
    from quant.whatif_onepass import whatif_onepass

    g = torch.Generator().manual_seed(0)
    step = [(torch.randn(*shape, generator=g), axis)
            for shape, axis, count in STEP_TENSORS for _ in range(count)]

    def per_format():
        for x, axis in step:
            {f: whatif(x, f, axis) for f in DEFAULT_WHATIF_FORMATS}

    def one_pass():
        for x, axis in step:
            whatif_onepass(x, DEFAULT_WHATIF_FORMATS, axis)

    runs = (("per format (before)", "0", per_format),
            ("per format, compiled", "1", per_format), ("one pass", "0", one_pass))
    for _, mode, fn in runs:                       # warm up; QUANT_COMPILE=1 compiles here
        os.environ["QUANT_COMPILE"] = mode
        fn()
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for r in range(args.rounds):
        for name, mode, fn in (runs if r % 2 == 0 else runs[::-1]):
            os.environ["QUANT_COMPILE"] = mode
            t0 = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t0)
    base, base_min = statistics.median(times[runs[0][0]]), min(times[runs[0][0]])
    print(f"{len(step)} tensors, formats {', '.join(DEFAULT_WHATIF_FORMATS)}; CPU ms per step "
          f"(thread time), {args.rounds} interleaved rounds"
          + ("" if accel.compile_error() is None else
             f"; torch.compile unavailable: {accel.compile_error()!r}"))
    print(f"{'path':<22}{'median':>9}{'ratio':>8}{'min':>9}{'ratio':>8}")
    for name, vals in times.items():
        med, low = statistics.median(vals), min(vals)
        print(f"{name:<22}{med * 1e3:>9.1f}{med / base:>7.3f}x{low * 1e3:>9.1f}"
              f"{low / base_min:>7.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
