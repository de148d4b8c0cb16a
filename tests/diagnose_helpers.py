"""The worker behind tests/test_diagnose_runtime.py: the tiny Llama driven by megatron-core's own
schedule on 2 ranks (gloo, data parallel), a stats-only capture of every iteration, one scenario
after another in the same processes (a new capture session each):

- ``nan_forward``: rank 0, a NaN in ``decoder.layers.1.mlp.linear_fc1``'s forward input at
  iteration :data:`NAN_ITERATION`, micro-batch 1 (a forward pre-hook);
- ``nan_backward``: rank 1, a NaN in the gradient reaching ``decoder.layers.0.mlp.linear_fc2``'s
  output (its backward ``grad_output``) at iteration 1, micro-batch 0 (a tensor hook; the loss of
  that micro-batch is computed before, so it stays finite);
- ``growth``: hifp8 emulation; ``decoder.layers.1.mlp.linear_fc1``'s weight multiplied by
  :data:`GROWTH` before every iteration (both ranks);
- ``healthy``: mxfp8 emulation with the default what-if set, nothing planted.

No optimizer runs (the weights change only where a scenario changes them), so a NaN stays in the
iteration it was planted in. Shims: those of :mod:`capture_runtime_helpers` (the schedules' CUDA
token counter on the CPU).
"""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import torch
from capture_helpers import tiny_shape
from capture_runtime_helpers import CpuScheduleTorch, _set_env, _use_tree

SCENARIOS = ("nan_forward", "nan_backward", "growth", "healthy")
ITERATIONS = 4
NAN_ITERATION = 2
GROWTH = 3.0
PLANTS = {  # scenario -> (rank, module, iteration, micro-batch)
    "nan_forward": (0, "decoder.layers.1.mlp.linear_fc1", NAN_ITERATION, 1),
    "nan_backward": (1, "decoder.layers.0.mlp.linear_fc2", 1, 0),
}
GROWN = "decoder.layers.1.mlp.linear_fc1"
EMULATED = {"growth": "hifp8", "healthy": "mxfp8"}


def _write_configs(out: Path) -> None:
    """Each scenario's YAML, written once by the parent before the ranks start: were every rank
    to write it, one rank could read it while another has just truncated it (an empty file is
    the default configuration: not stats-only, so that rank alone would enter the budget
    agreement and its peer would hang up on it)."""
    for scen in SCENARIOS:
        text = "stats_only: true\nmax_iterations: unlimited\n"
        if scen == "healthy":
            text += "whatif_formats: default\nwhatif_budget: unlimited\n"
        (out / f"{scen}.yaml").write_text(text)


def _env(scen: str, out: Path) -> dict[str, str]:
    yaml = out / f"{scen}.yaml"
    env = dict(TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(out / scen),
               TENSOR_SAVE_CONFIG=str(yaml))
    if scen in EMULATED:
        env["CUSTOM_QUANT_TYPE"] = EMULATED[scen]
    return env


class _Planter:
    """Hooks that put one NaN into a module's forward input or output gradient at one
    (iteration, micro-batch)."""

    def __init__(self, module: torch.nn.Module, where: str, iteration: int, micro: int) -> None:
        self.iteration, self.micro, self.where = iteration, micro, where
        self.it, self.calls = -1, 0
        self.handle = (module.register_forward_pre_hook(self._pre) if where == "forward"
                       else module.register_forward_hook(self._post))

    def start(self, it: int) -> None:
        self.it, self.calls = it, 0

    def _hit(self) -> bool:
        hit = self.it == self.iteration and self.calls == self.micro
        self.calls += 1
        return hit

    def _pre(self, module, args):
        if not self._hit():
            return None
        x = args[0].clone()
        x.view(-1)[7] = float("nan")
        return (x, *args[1:])

    def _post(self, module, args, output):
        if self._hit():
            out = output[0] if isinstance(output, tuple) else output

            def poison(grad):
                grad = grad.clone()
                grad.view(-1)[7] = float("nan")
                return grad

            out.register_hook(poison)


def _train_one(me, shape, model, scen: str, rank: int, gen: torch.Generator) -> list[list[float]]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model_chunk):
        tokens = next(data_iterator)
        out = model_chunk(tokens, labels=tokens, **me.causal_inputs(tokens))

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    modules = dict(model.named_modules())
    planter = None
    if scen in PLANTS and PLANTS[scen][0] == rank:
        _, path, it, micro = PLANTS[scen]
        planter = _Planter(modules[path], "forward" if scen == "nan_forward" else "backward",
                           it, micro)
    losses = []
    for it in range(ITERATIONS):
        if scen == "growth" and it:
            with torch.no_grad():
                modules[GROWN].weight.mul_(GROWTH)
        if planter is not None:
            planter.start(it)
        batches = [torch.randint(0, shape.vocab_size, (2, shape.seq_length), generator=gen)
                   for _ in range(2)]
        model.zero_grad(set_to_none=True)
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=2, seq_length=shape.seq_length, micro_batch_size=2,
            forward_only=False)
        losses.append([float(o["lm loss"]) for o in out])
    if planter is not None:
        planter.handle.remove()
    return losses


def diagnose_worker(rank: int, world: int, patched_dir: str, port: int, out_dir: str) -> None:
    out = Path(out_dir)
    _set_env(**_env(SCENARIOS[0], out))
    _use_tree(patched_dir)
    from training_driver import megatron_env as me

    me.init_distributed(rank, world, master_port=port)
    result: dict = {}
    try:
        from megatron.core.pipeline_parallel import schedules

        from megatron.core import tensor_saver as ts

        schedules.torch = CpuScheduleTorch(torch)
        shape = tiny_shape(me)
        model = me.build_llama_model(shape)
        init = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        for i, scen in enumerate(SCENARIOS):
            model.load_state_dict(init, strict=False)
            ts.reset_tensor_saver()
            _set_env(**_env(scen, out))
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                ts.get_tensor_saver()
                result[f"loss_{scen}"] = _train_one(me, shape, model, scen, rank,
                                                    torch.Generator().manual_seed(11 + rank))
                ts.get_tensor_saver().flush()
                ts.reset_tensor_saver()
            result[f"stderr_{scen}"] = err.getvalue()
    finally:
        torch.save(result, out / f"result_diagnose_rank{rank}.pt")
        os.environ.pop("CUSTOM_QUANT_TYPE", None)
        me.destroy_distributed()


def run_diagnose_scenarios(patched_dir: str, out_dir: Path, world: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    from training_driver.megatron_env import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    _write_configs(out_dir)
    mp.spawn(diagnose_worker, args=(world, patched_dir, free_port(), str(out_dir)), nprocs=world,
             join=True)
    return [torch.load(out_dir / f"result_diagnose_rank{r}.pt", weights_only=True)
            for r in range(world)]
