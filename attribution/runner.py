"""Training runs of an attribution, in long-lived worker processes (one import, data loaded once).

Each worker imports the patched megatron-core once, brings up a one-rank process group, loads the
tokenizer and keeps one dataset per seed; then it trains one run per task: a fresh model from the
seed (or the user's checkpoint), the format set through the same reading the training uses
(``tensor_capture.config.load_config`` of CUSTOM_QUANT_TYPE / CUSTOM_QUANT_PLAN), the steps of
``training_driver.train`` (its micro-batch schedule, AdamW, warmup + cosine, clipping), and
reports the final loss (mean of the last ``window`` steps). Workers run one intra-op thread each
(megatron_core_notes: two threads on two cores made steps bimodal), so W workers use W cores.
"""
from __future__ import annotations

import math
import os
import queue as queue_mod
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from lowp_common import UserError
from quant.vocabulary import ENV_COMPILE, ENV_CONFIG, ENV_ENABLED, ENV_PLAN, ENV_QUANT
from training_driver.train_config import TrainConfig


@dataclass(frozen=True)
class RunSetup:
    """What every run of an attribution shares."""

    data_path: str
    tokenizer: str
    model: str = "tiny"
    steps: int = 150
    # the optimizer settings default to llama-train's, so an attribution trains as the user's run does
    micro_batch_size: int = TrainConfig.micro_batch_size
    lr: float = TrainConfig.lr
    min_lr: float = TrainConfig.min_lr
    warmup_iters: int = TrainConfig.warmup_iters
    weight_decay: float = TrainConfig.weight_decay
    clip_grad: float = TrainConfig.clip_grad
    window: int = 0                 # steps averaged for the final loss (0: steps // 4)
    resume: Optional[str] = None    # checkpoint directory of the user's run
    patched_dir: Optional[str] = None

    @property
    def loss_window(self) -> int:
        return self.window or max(1, self.steps // 4)


@dataclass(frozen=True)
class RunTask:
    """One run: a seed, the format CUSTOM_QUANT_TYPE names, an optional plan file."""

    key: str
    seed: int
    quant_type: str
    plan_path: Optional[str] = None
    steps: Optional[int] = None     # calibration runs: fewer steps
    capture_env: tuple[tuple[str, str], ...] = ()   # e.g. TENSOR_SAVE_GUARD / TENSOR_SAVE_DIR


@dataclass
class RunResult:
    key: str
    seed: int
    loss: float
    seconds: float
    steps: int
    losses: list[float] = field(default_factory=list)
    error: Optional[str] = None
    step_seconds: float = math.nan      # per training step, over the second half of the steps


# ---- inside a worker ------------------------------------------------------------------------------
class _Worker:
    """The per-process state: megatron imported, process group up, datasets per seed."""

    def __init__(self, setup: RunSetup) -> None:
        self.setup = setup
        if setup.patched_dir:
            from training_driver.capture import PATCHED_DIR_ENV

            os.environ[PATCHED_DIR_ENV] = setup.patched_dir
        for var in (ENV_QUANT, ENV_PLAN, ENV_ENABLED, ENV_CONFIG):
            os.environ.pop(var, None)
        from training_driver.capture import activate_patched_megatron
        from training_driver.megatron_env import quiet_megatron_warnings

        quiet_megatron_warnings()
        activate_patched_megatron(setup.patched_dir or "runs/.patched_megatron")
        from megatron.core import tensor_saver  # noqa: F401  (the patched tree, or fail)
        from training_driver import megatron_env, preflight
        from training_driver.data.samples import check_data_prefix, check_tokenizer_matches
        from training_driver.data.tokenizer import load_tokenizer
        from training_driver.train import MODEL_SHAPES

        self.shape = dict(MODEL_SHAPES[setup.model])
        self.tokenizer = load_tokenizer(setup.tokenizer)
        check_data_prefix(setup.data_path)
        check_tokenizer_matches(setup.data_path, self.tokenizer)
        self.vocab = preflight.padded_vocab_size(self.tokenizer.vocab_size, 128, 1)
        megatron_env.init_distributed(0, 1, seed=1234, master_port=megatron_env.free_port())
        self.datasets: dict[int, Any] = {}
        self.checkpoint = load_checkpoint_state(setup.resume, self.shape, self.vocab) \
            if setup.resume else None

    def dataset(self, seed: int):
        if seed not in self.datasets:
            from training_driver.data.samples import build_gpt_dataset

            self.datasets[seed] = build_gpt_dataset(
                self.setup.data_path, self.tokenizer, self.shape["seq_length"],
                self.setup.steps * self.setup.micro_batch_size, seed)
        return self.datasets[seed]

    def configure(self, task: RunTask) -> None:
        """The emulation as the training reads it: CUSTOM_QUANT_TYPE / CUSTOM_QUANT_PLAN."""
        from megatron.core import tensor_saver
        from tensor_capture.config import load_config

        env = {ENV_QUANT: task.quant_type, **dict(task.capture_env)}
        if task.plan_path:
            env[ENV_PLAN] = task.plan_path
        tensor_saver.configure(load_config(env=env, underflow_warnings=False))

    def run(self, task: RunTask) -> RunResult:
        import torch

        from megatron.core import tensor_parallel
        from training_driver import optim
        from training_driver.capture import SaverHooks
        from training_driver.data.samples import BatchPlan
        from training_driver.megatron_env import LlamaShape, build_llama_model, causal_inputs
        from training_driver.plan_sites import check_plan_covers
        from training_driver.steps import simple_step

        t0 = time.perf_counter()
        s = self.setup
        steps = task.steps or s.steps
        self.configure(task)
        tensor_parallel.model_parallel_cuda_manual_seed(task.seed, inference_rng_tracker=True)
        torch.manual_seed(task.seed)
        model = build_llama_model(LlamaShape(vocab_size=self.vocab, **self.shape))
        optimizer = optim.build_adamw(list(model.parameters()), s.lr, s.weight_decay)
        warmup = s.warmup_iters
        if self.checkpoint is not None:
            model.load_state_dict(self.checkpoint["model"])
            optimizer.load_state_dict(self.checkpoint["optimizer"])
            warmup = 0
        check_plan_covers(model, task.plan_path)
        dataset = self.dataset(task.seed)
        plan = BatchPlan(s.micro_batch_size, 1, 1, 0)
        saver = SaverHooks()
        saver.resume_at(0)
        params = [p for p in model.parameters() if p.requires_grad]
        losses: list[float] = []
        t_steps = time.perf_counter()
        for it in range(steps):
            if it == steps // 2:      # the first steps warm caches up: time the second half
                t_steps = time.perf_counter()
            optim.set_lr(optimizer, optim.lr_at(it, s.lr, s.min_lr, warmup, s.steps))
            model.zero_grad(set_to_none=True)
            loss = simple_step(model, dataset, plan, it, torch.device("cpu"), saver,
                               causal_inputs, self.shape)
            if not math.isfinite(loss):
                losses.append(float("nan"))
                break
            norm = optim.grad_norm(params)
            optim.clip_grads(params, s.clip_grad, norm)
            optimizer.step()
            losses.append(loss)
        tensor_saver_closed()                 # what the run's capture keeps (guard) on disk
        tail = losses[-min(s.loss_window, len(losses)):]
        final = sum(tail) / len(tail) if len(losses) == steps else float("nan")
        now = time.perf_counter()
        timed = len(losses) - steps // 2
        per_step = (now - t_steps) / timed if timed > 0 and len(losses) > 1 else math.nan
        return RunResult(task.key, task.seed, final, now - t0, steps, losses,
                         step_seconds=per_step)


def tensor_saver_closed() -> None:
    """Close this run's capture session (a guard writes its summary and plan then)."""
    from megatron.core import tensor_saver

    tensor_saver.get_tensor_saver().close()


def load_checkpoint_state(directory: str, shape: dict, vocab: int) -> dict:
    """The latest checkpoint of ``directory`` (llama-train's layout), refused in one line when it
    holds another model than the one asked for."""
    from pathlib import Path

    import torch

    from training_driver.checkpoint import _shard_name, latest_iteration

    it = latest_iteration(directory)
    if it is None:
        raise UserError(f"--resume {directory}: no checkpoint there (no latest file); pass the "
                        "--checkpoint-dir of a llama-train run")
    path = Path(directory) / f"iter_{it:07d}" / _shard_name(0, 0)
    if not path.is_file():
        found = sorted(p.name for p in path.parent.glob("*.pt"))
        raise UserError(f"--resume {directory}: {path.name} missing (found {found}); attribution "
                        "resumes a tensor/pipeline-parallel size 1 checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UserError(f"--resume {path}: cannot be loaded "
                        f"({str(exc).splitlines()[0][:160]})") from None
    saved = state.get("config", {}) if isinstance(state, dict) else {}
    want = {**shape, "padded_vocab_size": vocab}
    bad = {k: (saved.get(k), v) for k, v in want.items() if k in saved and saved[k] != v}
    if bad or "model" not in state:
        k, (have, need) = next(iter(bad.items())) if bad else ("model", (None, "weights"))
        raise UserError(f"--resume {directory}: the checkpoint is of another model ({k}={have}, "
                        f"this run has {need}); pass the --model / --tokenizer it was trained "
                        "with")
    return state


def _worker_main(setup: RunSetup, tasks, results) -> None:
    # quant's background compile swaps kernels mid-run: a repeated run then drifted from its
    # first steps on (not bit-identical here), and the compile competes for the worker's core
    os.environ[ENV_COMPILE] = "0"
    try:
        worker = _Worker(setup)
    except BaseException as exc:
        results.put(("init-error", _one_line(exc)))
        return
    results.put(("ready", None))
    while True:
        task = tasks.get()
        if task is None:
            return
        try:
            results.put(("result", worker.run(task)))
        except BaseException as exc:
            results.put(("result", RunResult(task.key, task.seed, float("nan"), 0.0, 0,
                                             error=_one_line(exc))))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, UserError) else f"{type(exc).__name__}: {text}"


class WorkerPool:
    """``workers`` spawned processes running RunTasks; results come back as they finish."""

    def __init__(self, setup: RunSetup, workers: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.tasks = ctx.Queue()
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker_main, args=(setup, self.tasks, self.results),
                                  daemon=True) for _ in range(workers)]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            kind, info = self._get()
            if kind == "init-error":
                self.close()
                raise UserError(info)

    def _get(self, timeout: float = 3600.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.results.get(timeout=5.0)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in self.procs):
                    raise RuntimeError("every attribution worker exited") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("no attribution result within an hour") from None

    def map(self, tasks: Iterable[RunTask],
            on_result: Callable[[RunResult], None] | None = None) -> list[RunResult]:
        """Run ``tasks`` (in any order over the workers); results in the order they finish."""
        todo = list(tasks)
        for t in todo:
            self.tasks.put(t)
        out = []
        for _ in todo:
            kind, res = self._get()
            out.append(res)
            if on_result is not None:
                on_result(res)
        return out

    def close(self) -> None:
        for _ in self.procs:
            self.tasks.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()

