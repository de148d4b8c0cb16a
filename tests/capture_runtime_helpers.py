"""Workers for the runtime capture tests on real megatron-core (run in spawned processes).

``schedule_worker`` drives megatron-core's own forward-backward schedule
(``get_forward_backward_func()`` of the PATCHED copy) with no saver call in the loop.
``fusion_worker`` runs the real ColumnParallelLinear / RowParallelLinear under
``gradient_accumulation_fusion`` with :class:`ApexWgradStandIn` in place of apex.

Narrow shims CPU-only torch forces (each named):
- :class:`CpuScheduleTorch`: megatron-core 0.16.1's schedules allocate their token counter with
  ``device="cuda"``; only that module's ``torch.zeros`` is redirected to the CPU;
- :class:`ApexWgradStandIn`: apex's ``fused_weight_gradient_mlp_cuda`` is CUDA-only; the stand-in
  has the same two functions and arguments, in pure torch (fp32 accumulation for a float32
  main_grad, as the kernel), injected into ``sys.modules`` before megatron imports it;
- ``megatron.training.global_vars`` (Megatron-LM, not part of megatron-core) is stood in by a
  module holding ``_GLOBAL_ARGS.iteration`` only in the resume scenario.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import types
from pathlib import Path

import torch
from capture_helpers import tiny_shape

CAPTURE_ENV = ("TENSOR_SAVE_ENABLED", "CUSTOM_QUANT_TYPE", "TENSOR_SAVE_CONFIG",
               "TENSOR_SAVER_ITERATION", "TENSOR_SAVE_DIR")


class CpuScheduleTorch:
    """``torch`` for megatron's schedules module, with ``zeros(device="cuda")`` on the CPU."""

    def __init__(self, real: types.ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def zeros(self, *args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return self._real.zeros(*args, **kwargs)


class ApexWgradStandIn(types.ModuleType):
    """Stand-in for apex's ``fused_weight_gradient_mlp_cuda`` (main_grad += grad_outputᵀ·input)."""

    def __init__(self) -> None:
        super().__init__("fused_weight_gradient_mlp_cuda")
        self.calls = 0

    def wgrad_gemm_accum_fp32(self, input, grad_output, main_grad):
        self.calls += 1
        main_grad.add_(torch.matmul(grad_output.t().float(), input.float()))

    def wgrad_gemm_accum_fp16(self, input, grad_output, main_grad):
        self.calls += 1
        main_grad.add_(torch.matmul(grad_output.t(), input).to(main_grad.dtype))


def _use_tree(patched_dir: str) -> None:
    # drop other patched copies (a real megatron/core package with tensor_saver.py); keep this
    # repository (its megatron/core has no __init__.py)
    sys.path[:] = [p for p in sys.path if not ((Path(p) / "megatron/core/tensor_saver.py").is_file()
                                               and (Path(p) / "megatron/core/__init__.py").is_file())]
    sys.path.insert(0, patched_dir)


def _set_env(**env: str) -> None:
    for var in CAPTURE_ENV:
        os.environ.pop(var, None)
    os.environ.update(env)


# -- the schedule ------------------------------------------------------------------------------------
SCHEDULE_SCENARIOS = ("auto3", "default", "resume", "override", "warn_mxfp4", "quiet_mxfp4")


def _schedule_setup(patched_dir: str, port: int):
    _use_tree(patched_dir)
    from training_driver import megatron_env as me

    me.init_distributed(0, 1, master_port=port)
    import megatron.core.pipeline_parallel.schedules as schedules

    schedules.torch = CpuScheduleTorch(torch)
    shape = tiny_shape(me)
    return me, shape


def _train(me, shape, model, iterations: int, eval_after: int | None = None,
           seed: int = 11) -> list[torch.Tensor]:
    """``iterations`` calls of megatron-core's schedule, 2 micro-batches each; no saver call."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gen = torch.Generator().manual_seed(seed)

    def forward_step(data_iterator, model_chunk):
        tokens = next(data_iterator)
        out = model_chunk(tokens, labels=tokens, **me.causal_inputs(tokens))

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    losses = []
    for it in range(iterations):
        batches = [torch.randint(0, shape.vocab_size, (2, shape.seq_length), generator=gen)
                   for _ in range(2)]
        model.zero_grad(set_to_none=True)
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=2, seq_length=shape.seq_length, micro_batch_size=2,
            forward_only=False)
        losses.append(torch.stack([o["lm loss"] for o in out]))
        losses.append(torch.cat([p.grad.flatten() for p in model.parameters()
                                 if p.grad is not None]))
        if eval_after is not None and it == eval_after:
            other = torch.Generator().manual_seed(seed + 1)   # the training data stays the same
            evals = iter([torch.randint(0, shape.vocab_size, (2, shape.seq_length), generator=other)
                          for _ in range(2)])
            with torch.no_grad():
                get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=evals, model=[model],
                    num_microbatches=2, seq_length=shape.seq_length, micro_batch_size=2,
                    forward_only=True)
    return losses


def _scenario_env(scen: str, out: Path) -> dict[str, str]:
    env = dict(TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(out / scen))
    yaml = out / f"{scen}.yaml"
    text = {"auto3": "max_iterations: 3\n", "resume": "max_iterations: 2\n",
            "override": "max_iterations: 2\n", "quiet_mxfp4": "underflow_warnings: false\n"}
    if scen.endswith("mxfp4"):
        env = dict(CUSTOM_QUANT_TYPE="mxfp4")
    if scen in text:
        yaml.write_text(text[scen])
        env["TENSOR_SAVE_CONFIG"] = str(yaml)
    if scen == "override":
        env["TENSOR_SAVER_ITERATION"] = "10"
    return env


def schedule_worker(rank: int, patched_dir: str, port: int, out_dir: str) -> None:
    out = Path(out_dir)
    # The first scenario's environment is set before megatron is imported, as in a real run:
    # the patched megatron's import starts capture, and the loop below never calls the saver.
    _set_env(**_scenario_env(SCHEDULE_SCENARIOS[0], out))
    at_import = io.StringIO()
    with contextlib.redirect_stderr(at_import):
        me, shape = _schedule_setup(patched_dir, port)
    result: dict = {}
    try:
        from megatron.core import tensor_saver as ts

        model = me.build_llama_model(shape)
        init = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        for i, scen in enumerate(SCHEDULE_SCENARIOS):
            model.load_state_dict(init, strict=False)
            if i:   # a new run in this process: what importing the patched megatron would do
                ts.reset_tensor_saver()
                _set_env(**_scenario_env(scen, out))
                if scen in ("resume", "override"):  # Megatron-LM's args after loading a checkpoint
                    gv = types.ModuleType("megatron.training.global_vars")
                    gv._GLOBAL_ARGS = types.SimpleNamespace(iteration=5)
                    sys.modules["megatron.training.global_vars"] = gv
                else:
                    sys.modules.pop("megatron.training.global_vars", None)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                if i and ts.env_requests_activity():
                    ts.get_tensor_saver()
                result[f"train_{scen}"] = _train(me, shape, model, 3,
                                                 eval_after=0 if scen == "auto3" else None)
                ts.get_tensor_saver().flush()
            result[f"stderr_{scen}"] = (at_import.getvalue() if i == 0 else "") + err.getvalue()
            print(err.getvalue(), file=sys.stderr)
        ts.reset_tensor_saver()
    finally:
        torch.save(result, out / "result_schedule.pt")
        me.destroy_distributed()


# -- gradient_accumulation_fusion ------------------------------------------------------------------
def _layers(fusion: bool, seed: int = 3):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron.core import ModelParallelConfig

    cfg = ModelParallelConfig(gradient_accumulation_fusion=fusion, use_cpu_initialization=True)
    torch.manual_seed(seed)
    init = torch.nn.init.normal_
    col = ColumnParallelLinear(64, 96, config=cfg, init_method=init, bias=False,
                               gather_output=False)
    row = RowParallelLinear(96, 64, config=cfg, init_method=init, bias=False,
                            input_is_parallel=True, skip_bias_add=True)
    with torch.no_grad():
        col.weight.mul_(0.05)
        row.weight.mul_(0.05)
    return col, row


def _micro_batches(n: int = 2):
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(32, 2, 64, generator=gen) * (1 + 3 * i) for i in range(n)]
    dys = [torch.randn(32, 2, 64, generator=gen) * 1e-2 for _ in range(n)]
    return xs, dys


def _run_pair(col, row, xs, dys, saver=None, main_grad: bool = True, added: bool = False):
    """Forward/backward of each micro-batch through col -> row; returns grads and outputs."""
    if main_grad:
        for w in (col.weight, row.weight):
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
            if added:
                w.grad_added_to_main_grad = False
    for w in (col.weight, row.weight):
        w.grad = None
    outs, dxs = [], []
    for i, (x, dy) in enumerate(zip(xs, dys)):
        if saver is not None:
            saver.set_sample_idx(i)
        x = x.clone().requires_grad_(True)
        h, _ = col(x)
        y, _ = row(h)
        y.backward(dy)
        outs.append(y.detach().clone())
        dxs.append(x.grad.clone())
    grads = {}
    for name, w in (("col", col.weight), ("row", row.weight)):
        grads[name] = (w.main_grad.clone() if main_grad and col.gradient_accumulation_fusion
                       else (w.grad.clone() if w.grad is not None else None))
    return {"grads": grads, "out": torch.stack(outs), "dx": torch.stack(dxs)}


def fusion_worker(rank: int, patched_dir: str, port: int, out_dir: str) -> None:
    _set_env()
    _use_tree(patched_dir)
    apex = ApexWgradStandIn()
    sys.modules[apex.__name__] = apex          # before megatron's layers.py imports it
    from training_driver import megatron_env as me

    me.init_distributed(0, 1, master_port=port)
    out = Path(out_dir)
    result: dict = {}
    try:
        import megatron.core.tensor_parallel.layers as layers

        from megatron.core import tensor_saver as ts

        result["fusion_available"] = layers._grad_accum_fusion_available
        xs, dys = _micro_batches()
        for emu in ("off", "mxfp8"):
            for fusion in (True, False):
                ts.reset_tensor_saver()
                if emu != "off":
                    ts.configure(enabled=False, quant_type=emu)
                col, row = _layers(fusion)
                before = apex.calls
                result[f"{emu}_{'fused' if fusion else 'unfused'}"] = _run_pair(col, row, xs, dys)
                result[f"{emu}_{'fused' if fusion else 'unfused'}_apex_calls"] = apex.calls - before
        # per micro-batch unfused emulated gradients (what capture must find)
        for i in range(len(xs)):
            ts.reset_tensor_saver()
            ts.configure(enabled=False, quant_type="mxfp8")
            col, row = _layers(False)
            result[f"mxfp8_unfused_mb{i}"] = _run_pair(col, row, xs[i:i + 1], dys[i:i + 1])
        # capture under fusion + emulation, with and without Megatron DDP's grad_added_to_main_grad
        for scen, added in (("capture", False), ("capture_ddp", True)):
            ts.reset_tensor_saver()
            saver = ts.configure(enabled=True, save_dir=str(out / scen), quant_type="mxfp8",
                                 save_quantized=True)
            col, row = _layers(True)
            ts.register_model(torch.nn.ModuleDict({"col": col, "row": row}))
            result[scen] = _run_pair(col, row, xs, dys, saver=saver, added=added)
            result[f"{scen}_added_flag"] = bool(getattr(col.weight, "grad_added_to_main_grad", False))
            saver.flush()
            ts.reset_tensor_saver()
        # LinearWithFrozenWeight: frozen layers under emulation and capture
        for scen, frozen in (("frozen", True), ("trainable", False)):
            ts.reset_tensor_saver()
            saver = ts.configure(enabled=frozen, save_dir=str(out / scen), quant_type="mxfp8")
            col, row = _layers(False)
            for w in (col.weight, row.weight):
                w.requires_grad_(not frozen)
            ts.register_model(torch.nn.ModuleDict({"col": col, "row": row}))
            result[scen] = _run_pair(col, row, xs, dys, saver=saver, main_grad=False)
            saver.flush()
            ts.reset_tensor_saver()
        ts.reset_tensor_saver()
        col, row = _layers(False)
        for w in (col.weight, row.weight):
            w.requires_grad_(False)
        result["frozen_off"] = _run_pair(col, row, xs, dys, main_grad=False)
    finally:
        torch.save(result, out / "result_fusion.pt")
        me.destroy_distributed()


def run_worker(worker, patched_dir: str, out_dir: Path, name: str) -> dict:
    import torch.multiprocessing as mp

    from training_driver.megatron_env import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(patched_dir, free_port(), str(out_dir)), nprocs=1, join=True)
    return torch.load(out_dir / f"result_{name}.pt", weights_only=True)


# -- the pipelining schedule (2 stages, 2 processes) ---------------------------------------------
def pipeline_worker(rank: int, world: int, patched_dir: str, port: int, out_dir: str) -> None:
    out = Path(out_dir)
    _set_env(TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(out / "pp"),
             TENSOR_SAVE_CONFIG=str(out / "pp.yaml"))
    _use_tree(patched_dir)
    from training_driver import megatron_env as me

    me.init_distributed(rank, world, pipeline_model_parallel_size=world, master_port=port)
    result: dict = {}
    try:
        import megatron.core.pipeline_parallel.schedules as schedules
        from megatron.core.pipeline_parallel import get_forward_backward_func

        schedules.torch = CpuScheduleTorch(torch)
        shape = tiny_shape(me)
        # isend/irecv pairs (gloo has no batched p2p)
        model = me.build_llama_model(shape, pipeline_dtype=torch.float32, batch_p2p_comm=False,
                                     pipeline_model_parallel_size=world)
        gen = torch.Generator().manual_seed(11)

        def forward_step(data_iterator, model_chunk):
            tokens = next(data_iterator)
            out_t = model_chunk(tokens, labels=tokens, **me.causal_inputs(tokens))

            def loss_func(per_token):
                loss = per_token.float().mean()
                return loss, {"lm loss": loss.detach()}

            return out_t, loss_func

        fb = get_forward_backward_func()
        result["schedule"] = fb.__name__
        for _ in range(3):
            batches = [torch.randint(0, shape.vocab_size, (2, shape.seq_length), generator=gen)
                       for _ in range(2)]
            fb(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
               num_microbatches=2, seq_length=shape.seq_length, micro_batch_size=2,
               forward_only=False)
        from megatron.core import tensor_saver as ts

        ts.get_tensor_saver().flush()
    finally:
        torch.save(result, out / f"result_pp_rank{rank}.pt")
        me.destroy_distributed()


def run_pipeline(patched_dir: str, out_dir: Path) -> list[dict]:
    import torch.multiprocessing as mp

    from training_driver.megatron_env import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    # written here, once: two ranks writing it at once could each read it truncated
    (out_dir / "pp.yaml").write_text("max_iterations: 3\n")
    mp.spawn(pipeline_worker, args=(2, patched_dir, free_port(), str(out_dir)), nprocs=2, join=True)
    return [torch.load(out_dir / f"result_pp_rank{r}.pt", weights_only=True) for r in range(2)]
