"""What our debug-API features cost on one TE linear's tensors, as a ratio to its GEMMs.

For a linear of 1B-model shape (tokens x hidden -> ffn: Llama 3.2 1B's fc1 is 2048 -> 8192),
the baseline is the layer's three GEMMs (fprop, dgrad, wgrad) timed in the same run; then one
``inspect_tensor`` call per tensor (activation, weight, gradient) of each feature, through
nvdlfw-inspect and the TE-namespace stand-in of the tests (the routing TE would do). The ratio
says how much a step of that layer grows on an iteration the feature runs (``freq`` spreads
it); ``max_elements`` caps the what-if work.

    python bench/bench_te_features.py                          # CPU, a scaled-down shape
    python bench/bench_te_features.py --tokens 4096 --hidden 2048 --ffn 8192 --device cuda
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lowp_common import CommandParser

ROOT = Path(__file__).resolve().parent.parent


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, device: str, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(tokens: int, hidden: int, ffn: int, device: str, repeats: int,
        formats: list[str], max_elements: int | None) -> list[tuple[str, float, float]]:
    sys.path.insert(0, str(ROOT / "tests"))
    import nvdlfw_inspect.api as debug_api
    from te_helpers import initialize, make_logger, te_linear_calls

    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(device)
    w = (torch.randn(ffn, hidden, generator=g) * 0.02).to(device)
    dy = (torch.randn(tokens, ffn, generator=g) * 1e-3).to(device)
    gemms = _time(lambda: (x @ w.t(), dy @ w, dy.t() @ x), device, repeats)
    rows = [("three GEMMs (baseline)", gemms, 1.0)]
    layer = "model.decoder.layers.1.mlp.linear_fc1"
    tensors = {"activation": x, "weight": w, "gradient": dy}
    cap = f", max_elements: {max_elements}" if max_elements else ""
    with tempfile.TemporaryDirectory() as tmp:
        for feature, opts in (("LowpWhatIf", f"formats: [{', '.join(formats)}]{cap}"),
                              ("LowpBlockScaleStats",
                               f"formats: [{', '.join(f for f in formats if f.startswith(('mx', 'nv')))}]{cap}"),
                              ("LowpCapture", f"save_dir: {tmp}/caps, stats_only: True")):
            cfg = Path(tmp) / f"{feature}.yaml"
            cfg.write_text(f"s:\n  enabled: True\n  layers: {{layer_name_regex_pattern: .*}}\n"
                           f"  transformer_engine:\n    {feature}: {{enabled: True, "
                           f"tensors: [activation, weight, gradient], {opts}}}\n")
            initialize(cfg, Path(tmp) / "logs", make_logger())
            t = _time(lambda: te_linear_calls(layer, tensors, 0), device, repeats)
            debug_api.end_debug()
            rows.append((feature, t, t / gemms))
    return rows


def main(argv=None) -> int:
    p = CommandParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--formats", default="mxfp8,mxfp4,nvfp4,hifp8",
                   help="comma-separated what-if formats (block ones also for block stats)")
    p.add_argument("--max-elements", type=int, default=None)
    args = p.parse_args(argv)
    rows = run(args.tokens, args.hidden, args.ffn, args.device, args.repeats,
               args.formats.split(","), args.max_elements)
    print(f"linear {args.tokens}x{args.hidden} -> {args.ffn} on {args.device}, "
          f"median of {args.repeats}")
    for name, seconds, ratio in rows:
        print(f"  {name:24s} {seconds * 1e3:9.1f} ms   {ratio:6.2f}x the GEMMs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
