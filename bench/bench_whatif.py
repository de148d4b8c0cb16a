"""CPU time of one training step's what-if numerics: the default five formats format by format
(quant.whatif.whatif each; eager, and with quant.accel's compiled quantizers, QUANT_COMPILE=1)
against all five in one pass (quant.whatif_onepass), interleaved in one process, on Gaussian
tensors of the (sampled) shapes one step of bench_capture's model hands to the writer (2 layers,
hidden 512, 1024 tokens: 81 tensors, shapes below).

Why CPU time of the writer's work rather than step time: on a shared machine the step time
scatters by more than the what-if share; the thread's CPU seconds are what the what-if numbers
take from training (bench_capture.py measures the step itself).

    python bench/bench_whatif.py [--rounds 5]
    python bench/bench_whatif.py --capture [--rounds 6 --steps 25]

``--capture``: what stats-only capture with the default what-if numerics costs a training step
in steady state, on the embedded default model (training_driver's ``tiny`` Llama, micro-batch
4, megatron-core's schedule, fp32, one thread): one worker process per configuration (capture
off, statistics alone, statistics with what-if at the default ``whatif_budget`` and at 0.25),
each keeping ONE saver for the whole run as a training run does, rounds taken in turn. Each
worker's what-if gate runs on a clock that stands still between its rounds, so the budget sees
one continuous run (bench_capture.py builds a fresh saver per round, whose first iteration
always gets what-if numbers: a cost a run pays once). Times: CPU seconds of the worker process
per step (every thread: the writer's what-if work included) and wall seconds.
"""
from __future__ import annotations

import inspect
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

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
    ap.add_argument("--capture", action="store_true",
                    help="time stats-only capture with and without what-if numerics on the "
                         "embedded default model in steady state (module docstring)")
    ap.add_argument("--steps", type=int, default=25,
                    help="--capture: timed steps per configuration per round")
    args = ap.parse_args(argv)
    for flag, value in (("--rounds", args.rounds), ("--steps", args.steps)):
        if value < 1:
            ap.error(f"{flag} {value}: give a positive count")
    torch.set_num_threads(1)
    if args.capture:
        return capture_main(args.rounds, args.steps)
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



class _BusyClock:
    """perf_counter standing still while paused: a worker's what-if gate sees only its own
    rounds, as one continuous run."""

    def __init__(self) -> None:
        self.idle, self.paused_at = 0.0, time.perf_counter()

    def __call__(self) -> float:
        now = self.paused_at if self.paused_at is not None else time.perf_counter()
        return now - self.idle

    def pause(self) -> None:
        self.paused_at = time.perf_counter()

    def resume(self) -> None:
        self.idle += time.perf_counter() - self.paused_at
        self.paused_at = None


def _capture_worker(conn, patched: str, port: int, settings: dict | None, save_dir: str) -> None:
    """One configuration: build the embedded default model, configure capture once (``settings``
    None: capture off), then time the rounds the parent asks for."""
    for var in ("TENSOR_SAVE_ENABLED", "CUSTOM_QUANT_TYPE", "TENSOR_SAVE_CONFIG"):
        os.environ.pop(var, None)
    sys.path.insert(0, patched)
    torch.set_num_threads(1)
    from bench_capture import _schedule_step

    from training_driver import megatron_env as me
    from training_driver.collector import CollectRequest, prepare_default_data
    from training_driver.train_config import MODEL_SHAPES

    me.init_distributed(0, 1, master_port=port)
    vocab = inspect.signature(prepare_default_data).parameters["vocab_size"].default
    shape = me.LlamaShape(**MODEL_SHAPES["tiny"], vocab_size=vocab)   # the embedded run's
    model = me.build_llama_model(shape)
    tokens = torch.randint(0, shape.vocab_size, (CollectRequest.micro_batch_size, shape.seq_length),
                           generator=torch.Generator().manual_seed(0))
    schedule = _schedule_step(model, tokens, me.causal_inputs(tokens), 1, shape.seq_length)
    from megatron.core import tensor_saver as ts

    saver, clock = None, _BusyClock()
    if settings is not None:
        saver = ts.configure(enabled=True, save_dir=save_dir, stats_only=True,
                             max_iterations="unlimited", byte_budget="unlimited", **settings)
        saver.whatif_gate.clock = clock
    conn.send("ready")
    while (steps := conn.recv()) is not None:
        clock.resume()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            for p in model.parameters():
                p.grad = None
            schedule()
        if saver is not None:
            saver.flush()                 # what the writer has left counts too
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        clock.pause()
        gate = saver.whatif_gate if saver is not None else None
        conn.send((wall / steps, cpu / steps, len(gate.on) if gate else 0,
                   len(gate.on) + len(gate.skipped) if gate else 0))
    ts.reset_tensor_saver()
    me.destroy_distributed()


def capture_main(rounds: int, steps: int) -> int:
    from tensor_capture.config import WHATIF_BUDGET
    from tensor_capture.patcher import prepare_patched_megatron
    from training_driver.megatron_env import free_port

    work = Path(tempfile.mkdtemp(prefix="bench_whatif_"))
    patched = str(prepare_patched_megatron(work / "patched"))
    configs = {"capture off": None, "stats, no what-if": {"whatif_formats": ()},
               f"stats + what-if (budget {WHATIF_BUDGET:g}, default)": {"whatif_formats": "default"},
               "stats + what-if (budget 0.25)": {"whatif_formats": "default",
                                                 "whatif_budget": 0.25}}
    ctx, conns, procs = mp.get_context("spawn"), {}, []
    for i, (name, settings) in enumerate(configs.items()):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_capture_worker, daemon=True, args=(
            child, patched, free_port(), settings, str(work / f"cap{i}")))
        proc.start()
        conns[name] = parent
        procs.append(proc)
    for c in conns.values():
        assert c.recv() == "ready"
    for c in conns.values():                  # warm-up: the first iteration's what-if included
        c.send(3)
        c.recv()
    got: dict[str, list] = {name: [] for name in configs}
    for r in range(rounds):
        for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
            conns[name].send(steps)
            got[name].append(conns[name].recv())
    for c in conns.values():
        c.send(None)
    for proc in procs:
        proc.join(timeout=60)
    _print_capture(got, rounds, steps)
    return 0


def _print_capture(got: dict[str, list], rounds: int, steps: int) -> None:
    # the mean, not the median: an iteration with what-if numbers is a cost every few rounds
    mean = {name: (statistics.fmean(r[0] for r in rows), statistics.fmean(r[1] for r in rows))
           for name, rows in got.items()}
    off, alone = mean["capture off"], mean["stats, no what-if"]
    print(f"embedded default model (tiny Llama, micro-batch 4, 1 micro-batch); {rounds} rounds x "
          f"{steps} steps per configuration, one saver per configuration for the whole run; "
          "mean per step")
    print(f"{'configuration':<38}{'CPU ms':>8}{'/off':>7}{'/stats':>8}{'wall ms':>9}{'/off':>7}"
          f"{'/stats':>8}  what-if iterations")
    for name, (wall, cpu) in mean.items():
        on, total = got[name][-1][2:]
        print(f"{name:<38}{cpu * 1e3:>8.1f}{cpu / off[1]:>6.2f}x{cpu / alone[1]:>7.2f}x"
              f"{wall * 1e3:>9.1f}{wall / off[0]:>6.2f}x{wall / alone[0]:>7.2f}x  "
              + (f"{on} of {total}" if total else "-"))


if __name__ == "__main__":
    sys.exit(main())
