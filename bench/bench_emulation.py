"""What CUSTOM_QUANT_TYPE emulation costs: training-step time emulated / unemulated.

Three measurements, each a ratio against a baseline taken in the same run:

1. a Llama-style GPTModel on the patched megatron-core (default 4 layers, hidden 256, sequence
   256, batch 2): forward + backward with emulation off, then with each format, alternated
   round by round so load changes hit all alike (goal on a 2-core CPU: <= 1.5x);
2. one 4096 x 4096 linear layer, forward + backward, plain vs emulated (the GEMM-operand plan:
   six operand quantizations per step);
3. the first call's compile time on a cold torch.compile cache (a fresh process with an empty
   Inductor cache), per format.

    python bench/bench_emulation.py                 # CPU, formats mxfp8 hifp8 nvfp4
    python bench/bench_emulation.py --device cuda   # GPU (Triton kernels)
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lowp_common import CommandParser, HelpWithDefaults

DEFAULT_FORMATS = ("mxfp8", "hifp8", "nvfp4")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def model_ratios(formats, layers: int, hidden: int, seq: int, batch: int, rounds: int,
                 steps: int, device: str) -> dict[str, list[float]]:
    """Step times (seconds) per configuration ('off' and each format) on the patched model."""
    from tensor_capture.patcher import prepare_patched_megatron
    from training_driver.megatron_env import free_port

    work = Path(tempfile.mkdtemp(prefix="bench_emulation_"))
    sys.path.insert(0, str(prepare_patched_megatron(work / "patched")))
    from megatron.core import tensor_saver as ts
    from training_driver import megatron_env as me

    me.init_distributed(0, 1, master_port=free_port())
    shape = me.LlamaShape(num_layers=layers, hidden_size=hidden,
                          ffn_hidden_size=hidden * 8 // 3 // 8 * 8,
                          num_attention_heads=max(4, hidden // 64),
                          num_query_groups=max(2, hidden // 128), vocab_size=1024,
                          seq_length=seq)
    model = me.build_llama_model(shape)
    tokens = torch.randint(0, shape.vocab_size, (batch, seq),
                           generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(next(model.parameters()).device)
    inputs = me.causal_inputs(tokens)

    def step() -> float:
        for p in model.parameters():
            p.grad = None
        _sync(device)
        t0 = time.perf_counter()
        model(tokens, labels=tokens, **inputs).mean().backward()
        _sync(device)
        return time.perf_counter() - t0

    configs = ("off",) + tuple(formats)
    times: dict[str, list[float]] = {c: [] for c in configs}

    def run(config: str, n: int) -> list[float]:
        ts.reset_tensor_saver()
        ts.configure(enabled=False, quant_type=None if config == "off" else config,
                     underflow_warnings=False)
        return [step() for _ in range(n)]

    from quant import accel
    for c in configs:                 # warm-up: hot kernels, their background compiles
        run(c, 3)
    accel.wait_for_background()
    for c in configs:
        run(c, 1)
    from tqdm import tqdm
    for r in tqdm(range(rounds), desc="rounds", unit="round"):
        for c in (configs if r % 2 == 0 else configs[::-1]):
            times[c].extend(run(c, steps))
    ts.reset_tensor_saver()
    me.destroy_distributed()
    return times


def linear_ratios(formats, hidden: int, tokens: int, reps: int, device: str
                  ) -> dict[str, float]:
    """Median seconds of one linear layer's forward + backward, plain and emulated."""
    from quant.gemm_plan import emulated_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(device).requires_grad_()
    w = (torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(device).requires_grad_()

    def plain():
        torch.nn.functional.linear(x, w).sum().backward()

    calls = {"off": plain}
    for fmt in formats:
        calls[fmt] = (lambda fmt=fmt: emulated_linear(x, w, None, fmt).sum().backward())
    out: dict[str, list[float]] = {k: [] for k in calls}
    from quant import accel
    for fn in calls.values():         # warm-up: hot kernels, their background compiles
        for _ in range(3):
            fn()
    accel.wait_for_background()
    for fn in calls.values():
        fn()
    for r in range(reps):
        for name, fn in (list(calls.items()) if r % 2 == 0 else list(calls.items())[::-1]):
            x.grad = w.grad = None
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            out[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


_COLD = """
import sys, time, torch, quant
from quant import accel
x = torch.randn(int(sys.argv[2]), int(sys.argv[2]))
t0 = time.perf_counter(); quant.quantize(x, sys.argv[1]); first = time.perf_counter() - t0
accel.wait_for_background(); ready = time.perf_counter() - t0
t0 = time.perf_counter(); quant.quantize(x, sys.argv[1]); second = time.perf_counter() - t0
print(first, ready, second)
"""


def cold_compile(fmt: str, size: int) -> tuple[float, float, float]:
    """(first call, compiled kernel ready, a call after that) seconds of quant.quantize on a
    size x size CPU tensor in a fresh process whose Inductor cache is empty: the first call
    runs eagerly while the kernel compiles in the background."""
    with tempfile.TemporaryDirectory(prefix="inductor_cold_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=cache,
                   QUANT_COMPILE_AFTER="1")
        out = subprocess.run([sys.executable, "-c", _COLD, fmt, str(size)], env=env,
                             capture_output=True, text=True, check=True)
    first, ready, second = out.stdout.split()[-3:]
    return float(first), float(ready), float(second)


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(description=__doc__.split("\n\n")[0], formatter_class=HelpWithDefaults)
    ap.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS), help="formats")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size")
    ap.add_argument("--seq", type=int, default=256, help="sequence length")
    ap.add_argument("--batch", type=int, default=2, help="micro-batch size")
    ap.add_argument("--rounds", type=int, default=6, help="alternation rounds")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per configuration per round")
    ap.add_argument("--linear-hidden", type=int, default=4096, help="the linear layer's size")
    ap.add_argument("--linear-tokens", type=int, default=1024, help="tokens through the linear")
    ap.add_argument("--linear-reps", type=int, default=5, help="timed linear steps")
    ap.add_argument("--cold-size", type=int, default=4096,
                    help="tensor side for the cold-compile measurement (0: skip it)")
    ap.add_argument("--skip-model", action="store_true", help="skip the model measurement")
    args = ap.parse_args(argv)
    import quant
    for f in args.formats:
        quant.get_format(f)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_emulation: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else (
        f"CPU, {torch.get_num_threads()} threads")
    print(f"device: {args.device} ({where}); QUANT_COMPILE={os.environ.get('QUANT_COMPILE', 'auto')}")
    if not args.skip_model:
        t = model_ratios(args.formats, args.layers, args.hidden, args.seq, args.batch,
                         args.rounds, args.steps, args.device)
        base, base_min = statistics.median(t["off"]), min(t["off"])
        print(f"\nmodel: {args.layers} layers, hidden {args.hidden}, sequence {args.seq}, "
              f"batch {args.batch}; {args.rounds} rounds x {args.steps} steps")
        print(f"{'configuration':<14}{'median ms':>11}{'ratio':>8}{'min ms':>9}{'ratio':>8}"
              f"{'goal':>8}")
        for c, vals in t.items():
            med, low = statistics.median(vals), min(vals)
            print(f"{c:<14}{med * 1e3:>11.1f}{med / base:>7.2f}x{low * 1e3:>9.1f}"
                  f"{low / base_min:>7.2f}x{('' if c == 'off' else '<=1.5x'):>8}")
    lin = linear_ratios(args.formats, args.linear_hidden, args.linear_tokens, args.linear_reps,
                        args.device)
    print(f"\nlinear {args.linear_hidden}x{args.linear_hidden}, {args.linear_tokens} tokens, "
          "forward + backward (median)")
    for name, sec in lin.items():
        print(f"{name:<14}{sec * 1e3:>11.1f} ms{sec / lin['off']:>7.2f}x")
    if args.cold_size and not args.device.startswith("cuda"):
        print(f"\ncold compile cache, {args.cold_size}x{args.cold_size} float32: the first call "
              "(eager, while the kernel compiles in the background), when the compiled kernel "
              "is ready, a call after that")
        for fmt in args.formats:
            first, ready, second = cold_compile(fmt, args.cold_size)
            print(f"{fmt:<14}first {first:>6.2f} s   ready after {ready:>6.1f} s   then "
                  f"{second * 1e3:>7.1f} ms   goal: first call <= 3 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
