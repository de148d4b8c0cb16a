"""llama-train: a small, clear training loop for Llama-style GPT models on megatron-core.

megatron-core ships no training loop. This one: GPTModel (local layer spec, or Transformer
Engine's when TE and a GPU are present), AdamW with warmup + cosine decay, gradient clipping,
data parallel via torchrun plus tensor/pipeline parallel sizes from arguments, checkpoint
save/resume, logging of loss / grad norm / tokens per second, TensorBoard scalars. With the
patched megatron-core, capture numbers iterations and micro-batches through the same schedule
wrapper as under pretrain_gpt.py (``tensor_saver.wrap_schedule``). Same seed, same run.

Launch one process (``llama-train ...``) or several (``torchrun --nproc-per-node N -m
training_driver.train ...``); CPU uses gloo, CUDA uses nccl.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from lowp_common import CommandParser, HelpWithDefaults
from lowp_common.cli import UserError, cli_entry
from quant.vocabulary import ENV_DIR, ENV_PLAN, ENV_QUANT, ENV_TENSORBOARD

from .train_config import (
    DTYPES,
    MODEL_SHAPES,
    RESUME_MUST_MATCH,
    SHAPE_KEYS,
    TrainConfig,
    check_config,
    fp8_overrides,
)
from .train_log import TrainLogger


def _raise_keyboard_interrupt(signum, frame):  # SIGTERM from a launcher: stop like Ctrl-C
    raise KeyboardInterrupt


@contextlib.contextmanager
def _signals_held():
    """Ignore SIGINT and SIGTERM for the block (main thread only); SIGKILL still ends it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@dataclass
class RunPlan:
    """What the checks before training settle, for the steps after them: the derived sizes
    (``check_config``), the tokenizer, the padded vocabulary and the settings a checkpoint
    records (and a resumed run must share)."""

    cfg: TrainConfig
    rank: int
    world_size: int
    cuda: bool
    capture: bool
    patched: Any
    derived: dict[str, Any]
    tokenizer: Any
    padded_vocab: int
    run_config: dict[str, Any]

    @property
    def shape(self) -> dict[str, int]:
        return self.derived["shape"]


@dataclass
class _Open:
    """What a run has open and must close however it ends."""

    log: TrainLogger | None = None
    saver: Any = None


def train(cfg: TrainConfig, rank: int = 0, world_size: int = 1,
          master_port: int | None = None) -> dict[str, Any]:
    """Run training on this process (one of ``world_size``); returns a summary with the losses.

    Initializes and tears down torch.distributed and megatron's parallel state itself. The
    steps, in order: capture environment and patched megatron-core (before megatron is
    imported), checks and preflight (before any model is built), distributed init, then
    model, resume, loop and checkpoints (:func:`_run`).
    """
    capture, patched = _prepare_capture(cfg, rank)
    plan = _check_run(cfg, rank, world_size, capture, patched)
    from .megatron_env import destroy_distributed, init_distributed

    init_distributed(rank, world_size, cfg.tensor_model_parallel_size,
                     cfg.pipeline_model_parallel_size, seed=cfg.seed, master_port=master_port)
    opened = _Open()
    old_handler = _sigterm_as_ctrl_c()
    try:
        return _run(plan, opened)
    except KeyboardInterrupt:
        _close_after_interrupt(plan, opened.saver)
        raise
    finally:
        if opened.log is not None:
            opened.log.close()
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
        destroy_distributed()


def _prepare_capture(cfg: TrainConfig, rank: int) -> tuple[bool, Any]:
    """Whether tensor capture is asked for, and the patched megatron-core it activated (None:
    not asked, or the patch set is not installed). Runs before megatron is imported."""
    from .capture import activate_patched_megatron, capture_requested, check_capture_config

    capture = capture_requested()
    patched = None
    if capture and cfg.tensorboard_dir:
        # what-if numerics go beside the loss curves unless the user named another folder
        os.environ.setdefault(ENV_TENSORBOARD, cfg.tensorboard_dir)
    if capture:
        check_capture_config()
        workdir = cfg.patched_megatron_workdir or os.path.join(
            cfg.checkpoint_dir or "runs", ".patched_megatron", f"rank{rank}")
        patched = activate_patched_megatron(workdir)
    return capture, patched


def _check_run(cfg: TrainConfig, rank: int, world_size: int, capture: bool,
               patched: Any) -> RunPlan:
    """Settings, tokenizer and data checked, and (unless waived or done by the launcher) whether
    this node can hold the model and one captured iteration: all before any model exists."""
    from . import preflight
    from .data import samples as data
    from .data.tokenizer import load_tokenizer
    from .megatron_env import cuda_available

    cuda = cuda_available()
    derived = check_config(cfg, world_size, cuda, capture)
    tokenizer = load_tokenizer(cfg.tokenizer)
    data.check_data_prefix(cfg.data_path)
    data.check_tokenizer_matches(cfg.data_path, tokenizer)  # before any model is built
    padded_vocab = preflight.padded_vocab_size(tokenizer.vocab_size,
                                               cfg.make_vocab_size_divisible_by,
                                               cfg.tensor_model_parallel_size)
    if not (cfg.ignore_resource_check or os.environ.get(preflight.CHECKED_ENV)):
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        preflight.check_training_run(cfg, derived, padded_vocab, ranks,
                                     say=(lambda line: print(f"llama-train: {line}", flush=True))
                                     if rank == 0 else None)
    run_config = {**asdict(cfg), **derived["shape"], "padded_vocab_size": padded_vocab,
                  "global_batch_size": derived["global_batch_size"],
                  "data_parallel_size": derived["data_parallel_size"]}
    run_config.pop("shape", None)
    return RunPlan(cfg, rank, world_size, cuda, capture, patched, derived, tokenizer,
                   padded_vocab, run_config)


def _sigterm_as_ctrl_c() -> Any:
    """SIGTERM (a launcher stopping the run) raises KeyboardInterrupt from now on; returns the
    handler to put back, or None where no handler can be set (not the main thread)."""
    old_handler = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    except ValueError:  # not the main thread (e.g. inside a test runner thread)
        return None
    return old_handler


def _run(plan: RunPlan, opened: _Open) -> dict[str, Any]:
    """Model, resume, loop and checkpoints, on initialized process groups."""
    from megatron.core import parallel_state as ps

    from .capture import SaverHooks
    from .data import samples as data

    cfg = plan.cfg
    batches = data.BatchPlan(cfg.micro_batch_size, plan.derived["num_micro_batches"],
                             plan.derived["data_parallel_size"], ps.get_data_parallel_rank())
    is_logger = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 \
        and ps.get_data_parallel_rank() == 0
    opened.log = log = TrainLogger(cfg.log_interval, cfg.tensorboard_dir, cfg.progress_file,
                                   enabled=is_logger)
    if plan.rank == 0:
        _announce(plan)
    model, master, optimizer = _build_model(plan)
    start = _resume(plan, model, optimizer, master)
    if start >= cfg.train_iters:
        log.say(f"llama-train: checkpoint is already at iteration {start} >= --train-iters "
                f"{cfg.train_iters}; nothing to do")
        return {"losses": [], "start_iteration": start, "iterations": start}
    dataset = data.build_gpt_dataset(cfg.data_path, plan.tokenizer, plan.shape["seq_length"],
                                     cfg.train_iters * batches.global_batch_size, cfg.seed)
    opened.saver = saver = SaverHooks()
    saver.resume_at(start)
    saver.recorder_setup(cfg, plan.world_size, batches.global_batch_size)
    loop = _Loop(plan, model, master, optimizer, dataset, batches,
                 next(model.parameters()).device, saver, log)
    losses = loop.run(start)
    saver.close()
    return {"losses": losses, "start_iteration": start, "iterations": cfg.train_iters,
            "padded_vocab_size": plan.padded_vocab, "capture": saver.active}


def _announce(plan: RunPlan) -> None:
    """Rank 0's lines on what runs: shape, vocabulary, parallelism, device, layers, capture."""
    cfg, derived = plan.cfg, plan.derived
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    print(f"llama-train: {cfg.model} model {plan.shape}, vocabulary {plan.tokenizer.vocab_size} "
          f"(padded {plan.padded_vocab}), {plan.world_size} process(es): DP "
          f"{derived['data_parallel_size']} x TP {tp} x PP {pp}, "
          f"{'CUDA/nccl' if plan.cuda else 'CPU/gloo'}, dtype {cfg.dtype}, "
          f"{'Transformer Engine' if derived['use_te'] else 'local'} layers", flush=True)
    if plan.capture:
        state = ("ON via " + str(plan.patched) if plan.patched else
                 "requested but the patch set is not installed: training unpatched")
        print(f"llama-train: tensor capture {state}"
              f" ({ENV_DIR}={os.environ.get(ENV_DIR, '<saver default>')}, "
              f"{ENV_QUANT}={os.environ.get(ENV_QUANT, '<unset>')})", flush=True)


def _build_model(plan: RunPlan) -> tuple[Any, Any, Any]:
    """The GPT model in its dtype, its fp32 master parameters and AdamW over them."""
    import torch

    from . import optim
    from .megatron_env import LlamaShape, build_llama_model

    cfg = plan.cfg
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    shape = LlamaShape(vocab_size=plan.padded_vocab, rotary_base=cfg.rotary_base, **plan.shape)
    params_dtype = torch.float32 if cfg.dtype == "fp32" else torch.bfloat16
    overrides: dict[str, Any] = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if pp > 1:
        overrides["pipeline_dtype"] = params_dtype
    overrides.update(fp8_overrides(cfg.dtype, plan.derived["te_custom_recipe"]))
    model = build_llama_model(shape, params_dtype=params_dtype, use_te=plan.derived["use_te"],
                              **overrides)
    if pp == 1:   # a plan rule that matches no GEMM of this model: refused, not ignored
        from .plan_sites import check_plan_covers

        check_plan_covers(model, os.environ.get(ENV_PLAN, "").strip())
    if params_dtype != torch.float32:
        model = model.to(params_dtype)   # all of it, norms included, as Megatron's Float16Module
    master = optim.MasterParams(model)
    optimizer = optim.build_adamw(master.params, cfg.lr, cfg.weight_decay)
    return model, master, optimizer


def _resume(plan: RunPlan, model: Any, optimizer: Any, master: Any) -> int:
    """The iteration to start from: the latest checkpoint's (loaded into model, optimizer and
    master weights) or 0."""
    from . import checkpoint

    cfg = plan.cfg
    if not (cfg.checkpoint_dir and cfg.resume):
        return 0
    start = checkpoint.load_checkpoint(cfg.checkpoint_dir, model, optimizer, plan.run_config,
                                       RESUME_MUST_MATCH, master=master)
    if start and plan.rank == 0:
        print(f"llama-train: resumed from {cfg.checkpoint_dir} at iteration {start}", flush=True)
    return start


@dataclass
class _Loop:
    """The training loop over built parts: one iteration, then what follows it (divergence,
    a stop request, checkpoints)."""

    plan: RunPlan
    model: Any
    master: Any
    optimizer: Any
    dataset: Any
    batches: Any
    device: Any
    saver: Any
    log: TrainLogger

    def run(self, start: int) -> list[float]:
        cfg = self.plan.cfg
        losses: list[float] = []
        tokens_per_iter = self.batches.global_batch_size * self.plan.shape["seq_length"]
        for it in range(start, cfg.train_iters):
            loss, norm, lr, seconds = self.iteration(it)
            losses.append(loss)
            self.saver.report(float(norm))        # the flight recorder's grad-norm trigger
            self.log.iteration(it, cfg.train_iters, {"loss": loss, "grad_norm": float(norm),
                                                     "lr": lr,
                                                     "tokens_per_s": tokens_per_iter / seconds,
                                                     "seconds": seconds})
            if self.after_iteration(it, loss):
                break
        return losses

    def iteration(self, it: int) -> tuple[float, Any, float, float]:
        """One optimizer step: (loss averaged over data parallel ranks, gradient norm before
        clipping, learning rate, seconds)."""
        import torch

        from . import optim
        from .megatron_env import causal_inputs
        from .steps import average_loss_over_dp, pipeline_step, simple_step

        cfg, params = self.plan.cfg, self.master.params
        step = pipeline_step if cfg.pipeline_model_parallel_size > 1 else simple_step
        t0 = time.perf_counter()
        lr = optim.lr_at(it, cfg.lr, cfg.min_lr, cfg.warmup_iters, cfg.train_iters)
        optim.set_lr(self.optimizer, lr)
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        loss = step(self.model, self.dataset, self.batches, it, self.device, self.saver,
                    causal_inputs, self.plan.shape)
        self.master.grads_to_master()
        optim.average_data_parallel_grads(params)
        norm = optim.grad_norm(params)
        optim.clip_grads(params, cfg.clip_grad, norm)
        self.optimizer.step()
        self.master.master_to_model()
        loss = average_loss_over_dp(loss, self.device)
        if self.plan.cuda:
            torch.cuda.synchronize()
        return loss, norm, lr, time.perf_counter() - t0

    def after_iteration(self, it: int, loss: float) -> bool:
        """Stop on a non-finite loss (an error) or a stop request, save a checkpoint when due;
        True when the loop ends here. Every rank decides alike (``agree``)."""
        from megatron.core import parallel_state as ps

        from . import checkpoint
        from .steps import agree

        cfg, log = self.plan.cfg, self.log
        diverged, stop = agree(self.device, ps.is_pipeline_last_stage() and not math.isfinite(loss),
                               bool(cfg.stop_file) and os.path.exists(cfg.stop_file))
        if diverged and self.saver.capturing_after(it):
            log.say(f"llama-train: the loss is no longer finite at iteration {it + 1}; "
                    "going on while the flight recorder captures the iterations after it")
        elif diverged:
            raise UserError(f"the loss is no longer finite at iteration {it + 1}: lower --lr "
                            "or check the data")
        done = it + 1
        if stop and done < cfg.train_iters:
            log.say(f"llama-train: stop requested ({cfg.stop_file}); stopping after "
                    f"iteration {done}")
        exiting = (bool(cfg.exit_interval) and done % cfg.exit_interval == 0) or stop
        if cfg.checkpoint_dir and ((cfg.save_interval and done % cfg.save_interval == 0)
                                   or done == cfg.train_iters or exiting):
            path = checkpoint.save_checkpoint(cfg.checkpoint_dir, done, self.model, self.optimizer,
                                              self.plan.run_config, self.master.state())
            log.say(f"llama-train: saved checkpoint {path}")
        if exiting and done < cfg.train_iters:
            if not stop:
                log.say(f"llama-train: stopping after iteration {done} (--exit-interval)")
            return True
        return False


def _close_after_interrupt(plan: RunPlan, saver: Any) -> None:
    """Ctrl-C or SIGTERM: the saver's queued files written, and one line on what is kept."""
    if saver is not None:
        with _signals_held():        # a second Ctrl-C (or the collector's SIGTERM) must not
            saver.close()            # cut the flush short: the queued files get written
    where = os.environ.get(ENV_DIR)
    if plan.rank == 0:
        cfg = plan.cfg
        print("llama-train: interrupted; " + (f"tensors saved so far are complete in {where}"
              if where and plan.capture else "no tensors were being saved")
              + (f"; the last checkpoint is in {cfg.checkpoint_dir}" if cfg.checkpoint_dir else ""),
              file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="llama-train",
        description="Train a Llama-style GPT on megatron-core (CPU gloo or CUDA nccl). Set "
                    "TENSOR_SAVE_ENABLED=true and CUSTOM_QUANT_TYPE to capture tensors through "
                    "the patched megatron-core. Launch several processes with torchrun.",
        formatter_class=HelpWithDefaults)
    d = TrainConfig("", "")
    p.add_argument("--data-path", required=True,
                   help="indexed dataset prefix from preprocess-corpus (…_text_document)")
    p.add_argument("--tokenizer", required=True,
                   help="tokenizer directory (ours, or a local Hugging Face one)")
    p.add_argument("--model", default=d.model, choices=sorted(MODEL_SHAPES),
                   help="model shape; the options below override single fields")
    for key in SHAPE_KEYS:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    p.add_argument("--rotary-base", type=int, default=d.rotary_base)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=d.make_vocab_size_divisible_by)
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                   help="fp32; bf16 (bf16 model, fp32 master weights); fp8 (Transformer Engine "
                        "hybrid recipe on a bf16 model, GPU only)")
    p.add_argument("--transformer-impl", default=d.transformer_impl, choices=("auto", "local", "te"),
                   help="auto: TE layers when TE and a GPU are present and no capture is asked")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data parallel size")
    p.add_argument("--train-iters", type=int, default=d.train_iters)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr", type=float, default=d.min_lr)
    p.add_argument("--warmup-iters", type=int, default=d.warmup_iters)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip-grad", type=float, default=d.clip_grad, help="0 disables clipping")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--checkpoint-dir", default=None,
                   help="save checkpoints here and resume from the latest one found")
    p.add_argument("--save-interval", type=int, default=0,
                   help="also save every N iterations (the last iteration is always saved)")
    p.add_argument("--exit-interval", type=int, default=0,
                   help="stop (after saving a checkpoint) once the iteration is a multiple of N")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="ignore an existing checkpoint in --checkpoint-dir (with --force: "
                        "start over there, replacing its checkpoints as this run saves)")
    p.add_argument("--force", action="store_true",
                   help="let --no-resume replace the checkpoints an earlier run saved")
    p.add_argument("--tensorboard-dir", default=None)
    p.add_argument("--log-interval", type=int, default=d.log_interval)
    p.add_argument("--progress-file", default=None,
                   help="JSON file rewritten after every iteration (for watchers)")
    p.add_argument("--stop-file", default=None,
                   help="finish the current iteration and stop (checkpoint saved) once this "
                        "file exists; how the collector ends a run cleanly")
    p.add_argument("--ignore-resource-check", action="store_true",
                   help="start even when the memory / capture estimate says this machine cannot "
                        "hold the run (training_driver.preflight)")
    p.add_argument("--patched-megatron-workdir", default=None,
                   help="where to build the patched megatron-core copy when capturing")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)} - {"shape"}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def port_free(port: int) -> bool:
    """Whether a rendezvous could listen on ``port`` (any interface)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def check_restart(args: argparse.Namespace) -> None:
    """Output folders that cannot be written are refused before any work, and --no-resume in a
    --checkpoint-dir holding an earlier run's checkpoints (it would replace them as this run
    saves) without --force (issue 40: no result replaced silently)."""
    from lowp_common import check_writable, refuse_overwrite

    from .checkpoint import LATEST_FILE

    for flag in ("checkpoint_dir", "tensorboard_dir"):
        if getattr(args, flag):
            check_writable(getattr(args, flag), f"--{flag.replace('_', '-')}", folder=True)
    ckpt = args.checkpoint_dir
    if ckpt and not args.resume and os.path.isfile(os.path.join(ckpt, LATEST_FILE)):
        refuse_overwrite([ckpt], what="checkpoints", force=args.force,
                         elsewhere="give another --checkpoint-dir, or drop --no-resume to "
                                   "continue them")


@cli_entry("llama-train")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_restart(args)
    from .megatron_env import quiet_megatron_warnings

    quiet_megatron_warnings()
    cfg = config_from_args(args)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    under_launcher = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    port = None
    if not under_launcher:
        if os.environ.get("MASTER_PORT"):
            if not port_free(int(os.environ["MASTER_PORT"])):
                raise UserError(f"MASTER_PORT={os.environ['MASTER_PORT']} is in use: pick a free "
                                "port or unset MASTER_PORT")
        else:
            from .megatron_env import free_port
            port = free_port()
    try:
        summary = train(cfg, rank, world, master_port=port)
    except KeyboardInterrupt:
        return 130
    if rank == 0 and summary["losses"]:
        print(f"llama-train: done, {len(summary['losses'])} iterations, final loss "
              f"{summary['losses'][-1]:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
