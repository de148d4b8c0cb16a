"""Launch-shape sweep of the Triton quantizers on a GPU: GB/s per format and configuration.

Tries elements per program (element / per-tensor kernels), blocks per program (MX / NVFP4
tiles) and warps per program, by setting quant.triton_kernels' launch constants, and prints
(x read once + y written once) / time per configuration; pick the defaults from it.

    python bench/tune_triton.py                  # 8192 x 8192 bfloat16 on cuda
"""
from __future__ import annotations

import itertools
import sys

import torch

from lowp_common import CommandParser


def main(argv=None) -> int:
    ap = CommandParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["mxfp8", "mxfp4", "nvfp4", "hifp8",
                                                     "fp8_e4m3"])
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--elements", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    ap.add_argument("--blocks", nargs="+", type=int, default=[32, 64, 128, 256])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--stats", action="store_true", help="also sweep the statistics kernel")
    args = ap.parse_args(argv)
    import triton.testing

    import quant
    from quant import triton_kernels as tk
    x = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * x.numel() * x.element_size()
    ref = {f: quant.quantize(x, f, backend="triton") for f in args.formats}
    print(f"{'format':<10}{'elems':>7}{'blocks':>7}{'warps':>6}{'GB/s':>9}")
    for f in args.formats:
        block_fmt = quant.get_format(f).is_block
        best = (0, None)
        grid = itertools.product(args.elements if not block_fmt else [tk.ELEMENTS_PER_PROGRAM],
                                 args.blocks if block_fmt else [tk.BLOCKS_PER_PROGRAM],
                                 args.warps)
        for elems, blocks, warps in grid:
            tk.ELEMENTS_PER_PROGRAM, tk.BLOCKS_PER_PROGRAM = elems, blocks
            tk.NUM_WARPS = {k: warps for k in tk.NUM_WARPS}
            y = quant.quantize(x, f, backend="triton")
            assert torch.equal(y.view(torch.int16), ref[f].view(torch.int16)), (f, elems, blocks)
            ms = triton.testing.do_bench(lambda: quant.quantize(x, f, backend="triton"),
                                         return_mode="median")
            gbps = nbytes / ms / 1e6
            best = max(best, (gbps, (elems, blocks, warps)))
            print(f"{f:<10}{elems:>7}{blocks:>7}{warps:>6}{gbps:>9.1f}")
        print(f"best {f}: {best[0]:.1f} GB/s at elements/blocks/warps {best[1]}")
    if args.stats:
        stats_sweep(x)
    return 0


def stats_sweep(x: torch.Tensor) -> None:
    """The fused statistics pass: tile size x warps x histogram window."""
    import triton.testing

    from tensor_capture import stats
    from tensor_capture import stats_kernel as sk
    ranges = [stats.format_range(f) for f in ("fp8_e4m3", "fp8_e5m2", "hifp8")]
    ref = stats.compute(x, ranges, kernel=True).cpu()
    clone_ms = triton.testing.do_bench(lambda: x.clone(), return_mode="median")
    print(f"stats on {tuple(x.shape)} {x.dtype}; clone {clone_ms * 1e3:.1f} us")
    print(f"{'elems':>7}{'warps':>6}{'window':>7}{'us':>9}{'read GB/s':>11}")
    for elems, warps, window in itertools.product((4096, 8192, 16384, 32768), (4, 8, 16),
                                                  (32, 64, 128)):
        sk.ELEMENTS_PER_PROGRAM, sk.NUM_WARPS, sk.WINDOW = elems, warps, window
        got = stats.compute(x, ranges, kernel=True).cpu()
        assert torch.equal(got[9:], ref[9:]), (elems, warps, window)
        ms = triton.testing.do_bench(lambda: stats.compute(x, ranges, kernel=True),
                                     return_mode="median")
        print(f"{elems:>7}{warps:>6}{window:>7}{ms * 1e3:>9.1f}"
              f"{x.numel() * x.element_size() / ms / 1e6:>11.1f}")


if __name__ == "__main__":
    sys.exit(main())
