"""Step time of a Llama-style GPTModel: unpatched vs patched (disabled, stats-only with the
default what-if numerics, stats-only without them, full capture, the flight recorder with no
trigger (its step boundary included; recorder_torch: its CPU statistics by the torch passes
instead of the one-pass C kernel, the comparison in the same run), and --emulate FMT: emulation
with the underflow warning off and on). Capture modes wait for the background writer at the end
of each round of steps, so its work (statistics, what-if numerics, files) counts: a time is the
mean step of one round, writer drain included.

Why two long-lived worker processes driven in alternation: the unpatched and the patched
megatron-core cannot share one process, and on a busy machine separate back-to-back runs
differ by more than the 2 % being measured. Each worker builds the same model once; the
parent then asks them in turn for a few timed steps, round after round, and compares medians.

    python bench/bench_capture.py            # defaults: hidden 512, 2 layers, 1024 tokens/step
    python bench/bench_capture.py --modes disabled recorder recorder_torch --hidden 128 \
        --layers 4 --micro-batches 2 --rounds 5     # issue 50's recorder measurement
    python bench/bench_capture.py --help
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from lowp_common import CommandParser, HelpWithDefaults

MODES = ("disabled", "stats_only", "stats_whatif_all", "stats_no_whatif", "full", "recorder",
         "recorder_torch")
#: what a step is timed with: wall-clock time, or the worker process's CPU time (all its
#: threads; other processes' turns on a shared machine do not count, their cache traffic does)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
#: the flight recorder with its CPU rows from the one-pass C kernel, and from the torch passes
RECORDER_MODES = ("recorder", "recorder_torch")
EMULATION_MODES = ("emulate", "emulate_warn")   # CUSTOM_QUANT_TYPE, underflow_warnings off / on
#: modes whose saver has a background writer: a new saver each time the mode comes round (two
#: savers' writers side by side slowed each other's steps: stats-only 45 -> 62-73 ms a step on
#: the embedded default), its first iteration untimed
WRITER_MODES = ("stats_only", "stats_whatif_all", "stats_no_whatif", "full")


def _worker(conn, patched_dir: str | None, port: int, shape_kw: dict, batch: int,
            save_dir: str, stats_on_caller: bool, emulate: str | None = None,
            whatif_every: int = 1, micro_batches: int = 0, clock: str = "wall") -> None:
    now = CLOCKS[clock]
    for var in ("TENSOR_SAVE_ENABLED", "CUSTOM_QUANT_TYPE", "TENSOR_SAVE_CONFIG"):
        os.environ.pop(var, None)
    # drop patched copies (a real megatron/core package with tensor_saver.py); keep this
    # repository (its megatron/core holds only tensor_saver.py)
    sys.path[:] = [p for p in sys.path if not ((Path(p) / "megatron/core/tensor_saver.py").is_file()
                                               and (Path(p) / "megatron/core/__init__.py").is_file())]
    if patched_dir:
        sys.path.insert(0, patched_dir)
    from training_driver import megatron_env as me

    me.init_distributed(0, 1, master_port=port)
    shape = me.LlamaShape(**shape_kw)
    model = me.build_llama_model(shape)
    tokens = torch.randint(0, shape.vocab_size, (batch, shape.seq_length),
                           generator=torch.Generator().manual_seed(0))
    inputs = me.causal_inputs(tokens)
    schedule = _schedule_step(model, tokens, inputs, micro_batches, shape.seq_length)
    ts = None
    if patched_dir:
        from megatron.core import tensor_saver as ts

        ts.TensorSaver.host_stats_in_writer = not stats_on_caller

    def step() -> float:
        for p in model.parameters():
            p.grad = None
        t0 = now()
        if schedule is not None:
            schedule()
        else:
            model(tokens, labels=tokens, **inputs).mean().backward()
        return now() - t0

    def iterate(mode: str, steps: int) -> float:
        """``steps`` iterations of ``mode``; their CPU or wall time, the writer's drain included."""
        total = 0.0
        for _ in range(steps):
            total += step()
            if schedule is not None:      # the schedule numbers iterations, ends them
                continue
            if ts is not None and mode in RECORDER_MODES:   # its step boundary counts
                t0 = now()
                saver = ts.get_tensor_saver()
                saver.recorder.end_iteration(saver.iteration)
                total += now() - t0
            if ts is not None and mode != "disabled":
                ts.get_tensor_saver().step()  # next iteration (warnings: once per kind each)
        if ts is not None and mode in MODES[1:]:
            # steady state: the writer works beside the steps (a bounded queue stalls them
            # when it falls behind); what is left at the end counts too
            t0 = now()
            ts.get_tensor_saver().flush()
            total += now() - t0
        return total

    mode_now = None
    savers: dict[str, object] = {}        # a saver per mode kept across rounds (see _use_saver)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        mode, steps = msg
        quiet = contextlib.redirect_stderr(io.StringIO()) if mode == "emulate_warn" else (
            contextlib.nullcontext())
        if ts is not None and mode != mode_now:
            if mode_now in WRITER_MODES:      # its writer must not run beside another mode
                savers.pop(mode_now).close()
            fresh = savers.get(mode) is None
            savers[mode] = _use_saver(ts, savers.get(mode), mode, str(Path(save_dir) / mode),
                                      emulate, whatif_every)
            mode_now = mode
            if fresh and mode in WRITER_MODES:
                with quiet:               # untimed: what a run pays once (the first what-if
                    iterate(mode, 1)      # iteration, which the budget always admits)
        times = []
        with quiet:                                   # the warnings' text is not the point here
            total = iterate(mode, steps)
            times.append(total / steps)       # one mean step time per round
        conn.send(times)
    if ts is not None:
        for saver in savers.values():
            saver.close()
        ts.reset_tensor_saver()
    me.destroy_distributed()


def _use_saver(ts, saver, mode: str, save_dir: str, emulate: str | None, whatif_every: int):
    """Make ``mode``'s saver the process-wide one: ``saver`` again when the mode ran before
    (its state carried on: the recorder's slots and summaries), else a new one; the previous
    mode's saver is set aside, not closed. (A new recorder each round would make every round
    pay what a run pays once: its slots.)"""
    from tensor_capture import saver as saver_module
    from tensor_capture.state import STATE

    if saver is not None:
        STATE.saver = saver
        saver_module._set_flags(saver)
        return saver
    STATE.saver = None                    # set aside: configure() closes the current saver
    if mode in EMULATION_MODES:           # emulation only: nothing captured
        return ts.configure(enabled=False, quant_type=emulate,
                            underflow_warnings=(mode == "emulate_warn"))
    if mode in RECORDER_MODES:            # the flight recorder, no trigger
        saver = ts.configure(enabled=True, save_dir=save_dir, mode="recorder")
        saver.recorder.cpu_kernel = mode == "recorder"
        return saver
    if mode == "disabled":
        return ts.configure(enabled=False)
    # every step captured (no default bound); stats_only / full: with the what-if set (opt-in
    # in a user's config): stats_only within the default whatif_budget, stats_whatif_all on
    # every (whatif_every-th) iteration however long they take
    extra = ({"whatif_formats": ()} if mode == "stats_no_whatif" else
             {"whatif_formats": "default", "whatif_every": whatif_every})
    if mode == "stats_whatif_all":
        extra["whatif_budget"] = "unlimited"
    return ts.configure(enabled=True, save_dir=save_dir, stats_only=(mode != "full"),
                        max_iterations="unlimited", byte_budget="unlimited", **extra)


def _schedule_step(model, tokens: torch.Tensor, inputs: dict, micro_batches: int,
                   seq: int):
    """One iteration through megatron-core's own schedule (get_forward_backward_func: the
    patched copy numbers iterations and micro-batches and ends each iteration, the recorder's
    step boundary included), ``micro_batches`` of ``tokens`` each; None when 0 (a bare
    forward and backward per step)."""
    if not micro_batches:
        return None
    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not torch.cuda.is_available():     # the tests' shim: its token counter on the CPU
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from capture_runtime_helpers import CpuScheduleTorch

        schedules.torch = CpuScheduleTorch(torch)

    def forward_step(data_iterator, model_chunk):
        batch = next(data_iterator)
        out = model_chunk(batch, labels=batch, **inputs)
        return out, lambda per_token: (per_token.mean(), {"lm loss": per_token.detach().mean()})

    def run() -> None:
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([tokens] * micro_batches),
            model=[model], num_microbatches=micro_batches, seq_length=seq,
            micro_batch_size=tokens.shape[0], forward_only=False)

    return run


def off_cost(fmt: str, reps: int = 40) -> tuple[float, float]:
    """Median seconds of tensor_capture.emulation.quantize with the underflow warning off, and
    of quant.quantize itself, interleaved on one [4096, 256] operand: what "off" adds."""
    import quant
    from tensor_capture import emulation
    from tensor_capture.state import STATE

    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(1))
    STATE.warn_underflow = False
    ours, bare = [], []
    calls = ((ours, lambda: emulation.quantize(x, -1, fmt, kind="linear forward input",
                                               site=None, iteration=0)),
             (bare, lambda: quant.quantize(x, fmt, axis=-1)))
    for r in range(reps):                       # alternate which goes first
        for out, call in (calls if r % 2 == 0 else calls[::-1]):
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
    return statistics.median(ours), statistics.median(bare)


def main(argv: list[str] | None = None) -> int:
    ap = CommandParser(description=__doc__.split("\n\n")[0],
                       formatter_class=HelpWithDefaults)
    ap.add_argument("--hidden", type=int, default=512, help="hidden size")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers")
    ap.add_argument("--seq", type=int, default=256, help="sequence length")
    ap.add_argument("--batch", type=int, default=4, help="micro-batch size")
    ap.add_argument("--micro-batches", type=int, default=0, metavar="M",
                    help="run each step through megatron-core's schedule "
                         "(get_forward_backward_func) with M micro-batches of --batch "
                         "sequences; 0: one bare forward and backward per step")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="time steps by the wall clock, or by each worker's CPU time (steadier "
                         "on a machine others load)")
    ap.add_argument("--rounds", type=int, default=8, help="alternation rounds")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per mode per round")
    ap.add_argument("--stats-on-caller", action="store_true",
                    help="compute CPU statistics on the training thread instead of the writer thread")
    ap.add_argument("--emulate", default=None, metavar="FMT",
                    help="also time CUSTOM_QUANT_TYPE=FMT emulation with the underflow warning "
                         "off and on (e.g. mxfp8)")
    ap.add_argument("--whatif-every", type=int, default=1, metavar="N",
                    help="what-if numerics every N iterations in stats_only and full (config "
                         "whatif_every; stats_no_whatif has none)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=None,
                    help="time only these capture modes (default: all; the unpatched step is "
                         "always timed)")
    ap.add_argument("--workdir", default=None, help="where the patched copy and captures go "
                    "(default: a temporary directory, removed afterwards)")
    args = ap.parse_args(argv)
    if args.micro_batches < 0:
        ap.error(f"--micro-batches {args.micro_batches}: give 0 (bare steps) or a positive count")
    from tqdm import tqdm

    from tensor_capture.patcher import prepare_patched_megatron
    from training_driver.megatron_env import free_port

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_capture_"))
    patched = str(prepare_patched_megatron(work / "patched"))
    save_dir = str(work / "captures")
    shape_kw = dict(num_layers=args.layers, hidden_size=args.hidden,
                    ffn_hidden_size=args.hidden * 8 // 3 // 8 * 8,
                    num_attention_heads=max(4, args.hidden // 64),
                    num_query_groups=max(2, args.hidden // 128), vocab_size=1024,
                    seq_length=args.seq)
    ctx = mp.get_context("spawn")
    procs, conns = {}, {}
    for name, pdir in (("unpatched", None), ("patched", patched)):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, pdir, free_port(), shape_kw, args.batch,
                                              save_dir, args.stats_on_caller, args.emulate,
                                              args.whatif_every, args.micro_batches,
                                              args.clock),
                        daemon=True)
        p.start()
        procs[name], conns[name] = p, parent
    for c in conns.values():
        assert c.recv() == "ready"
    modes = tuple(m for m in MODES if args.modes is None or m in args.modes) + (
        EMULATION_MODES if args.emulate else ())
    plan = [("unpatched", "disabled")] + [("patched", m) for m in modes]
    for proc_name, mode in plan:                        # warm-up: one untimed round
        conns[proc_name].send((mode, 2))
        conns[proc_name].recv()
    times: dict[str, list[float]] = {f"{p}/{m}": [] for p, m in plan}
    for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
        order = plan if r % 2 == 0 else plan[::-1]
        for proc_name, mode in order:
            conns[proc_name].send((mode, args.steps))
            times[f"{proc_name}/{mode}"].extend(conns[proc_name].recv())
        for f in Path(save_dir).rglob("*"):      # keep the savers' folders, drop this round's files
            if f.is_file():
                f.unlink()
    for c in conns.values():
        c.send(None)
    for p in procs.values():
        p.join(timeout=60)
    base = statistics.median(times["unpatched/disabled"])
    base_min = min(times["unpatched/disabled"])
    tokens = args.batch * args.seq * max(args.micro_batches, 1)
    how = (f"megatron-core's schedule, {args.micro_batches} micro-batches"
           if args.micro_batches else "bare forward and backward")
    print(f"\nmodel: {args.layers} layers, hidden {args.hidden}, {tokens} tokens/step ({how}), "
          f"fp32, CPU 1 thread, {args.clock} clock; {args.rounds} rounds x {args.steps} steps "
          f"per mode; CPU "
          f"statistics on the {'training' if args.stats_on_caller else 'writer'} thread; what-if "
          f"numerics every {args.whatif_every} iteration(s)")
    print(f"{'configuration':<22}{'median (ms)':>13}{'ratio':>8}{'min (ms)':>11}{'ratio':>8}"
          f"{'goal':>9}")
    goals = {"patched/disabled": 1.02, "patched/stats_only": 1.30, "patched/recorder": 1.05}
    for key, vals in times.items():
        med, low = statistics.median(vals), min(vals)
        goal = goals.get(key)
        print(f"{key:<22}{med * 1e3:>13.1f}{med / base:>7.3f}x{low * 1e3:>11.1f}"
              f"{low / base_min:>7.3f}x{(f'<={goal:.2f}x' if goal else 'report'):>9}")
    print("(min: the least-disturbed step of each configuration; on a busy machine it is the "
          "steadier comparison)")
    if args.emulate:
        ours, bare = off_cost(args.emulate)
        print(f"underflow warning off: emulation.quantize {ours * 1e3:.2f} ms vs quant.quantize "
              f"{bare * 1e3:.2f} ms per [4096, 256] operand ({ours / bare:.3f}x)")
        on, off = times["patched/emulate_warn"], times["patched/emulate"]
        print(f"underflow warning on vs off ({args.emulate} emulation): median "
              f"{statistics.median(on) / statistics.median(off):.3f}x, min "
              f"{min(on) / min(off):.3f}x")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
