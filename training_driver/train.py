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
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .capture import emulation_requested
from .errors import UserError, cli_entry
from .train_log import TrainLogger

MODEL_SHAPES: dict[str, dict[str, int]] = {
    # A Llama in miniature: trains in seconds on 2 CPU cores.
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=172, num_attention_heads=4,
                 num_query_groups=2, seq_length=64),
    # Llama 3.2 1B (vocabulary comes from the tokenizer).
    "llama32_1b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                       num_attention_heads=32, num_query_groups=8, seq_length=2048),
}
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "seq_length")
DTYPES = ("fp32", "bf16", "fp8")
# Settings a resumed run must share with its checkpoint.
RESUME_MUST_MATCH = SHAPE_KEYS + ("padded_vocab_size", "tensor_model_parallel_size",
                                  "pipeline_model_parallel_size", "micro_batch_size",
                                  "global_batch_size", "seed")


@dataclass
class TrainConfig:
    data_path: str
    tokenizer: str
    model: str = "tiny"
    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    seq_length: int | None = None
    rotary_base: int = 500000
    make_vocab_size_divisible_by: int = 128
    dtype: str = "fp32"
    transformer_impl: str = "auto"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    micro_batch_size: int = 4
    global_batch_size: int | None = None
    train_iters: int = 20
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 2
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    checkpoint_dir: str | None = None
    save_interval: int = 0
    exit_interval: int = 0
    resume: bool = True
    tensorboard_dir: str | None = None
    log_interval: int = 1
    progress_file: str | None = None
    stop_file: str | None = None
    patched_megatron_workdir: str | None = None
    ignore_resource_check: bool = False
    shape: dict[str, int] = field(default_factory=dict)

    def resolved_shape(self) -> dict[str, int]:
        if self.model not in MODEL_SHAPES:
            raise UserError(f"--model {self.model!r} is unknown: choose one of {', '.join(MODEL_SHAPES)}")
        shape = dict(MODEL_SHAPES[self.model])
        for key in SHAPE_KEYS:
            value = getattr(self, key)
            if value is not None:
                shape[key] = value
        return shape


def _te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken TE both mean "no TE"
        return False
    return True


def check_config(cfg: TrainConfig, world_size: int, cuda: bool, capture: bool) -> dict[str, Any]:
    """Validate settings against the machine; returns derived values. UserError on a mistake."""
    if cfg.dtype not in DTYPES:
        raise UserError(f"--dtype {cfg.dtype!r} is unknown: choose one of {', '.join(DTYPES)}")
    if cfg.dtype == "fp8" and not (cuda and _te_available()):
        need = "a CUDA GPU" if not cuda else "Transformer Engine (pip install transformer-engine[pytorch])"
        raise UserError(f"--dtype fp8 needs {need}: use --dtype bf16, or CUSTOM_QUANT_TYPE to "
                        "emulate a low-precision format")
    for name in ("train_iters", "micro_batch_size", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "log_interval"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise UserError(f"{world_size} processes cannot be split into tensor parallel {tp} x "
                        f"pipeline parallel {pp}: launch a multiple of {tp * pp} processes")
    if pp > 1 and not cuda:
        raise UserError("--pipeline-model-parallel-size > 1 needs CUDA (megatron-core's pipeline "
                        "schedules allocate on the GPU); use tensor or data parallelism on CPU")
    dp = world_size // (tp * pp)
    shape = cfg.resolved_shape()
    if shape["num_attention_heads"] % tp or shape["num_query_groups"] % tp:
        raise UserError(f"attention heads ({shape['num_attention_heads']}) and query groups "
                        f"({shape['num_query_groups']}) must divide by tensor parallel size {tp}")
    if shape["num_layers"] % pp:
        raise UserError(f"{shape['num_layers']} layers do not split into {pp} pipeline stages")
    gbs = cfg.global_batch_size or cfg.micro_batch_size * dp
    if gbs % (cfg.micro_batch_size * dp):
        raise UserError(f"--global-batch-size {gbs} must be a multiple of micro batch size x "
                        f"data parallel size = {cfg.micro_batch_size * dp}")
    impl = cfg.transformer_impl
    if impl not in ("auto", "local", "te"):
        raise UserError(f"--transformer-impl {impl!r}: choose auto, local or te")
    if impl == "te" and not (cuda and _te_available()):
        raise UserError("--transformer-impl te needs Transformer Engine and a CUDA GPU")
    # Capture hooks sit in megatron's local layers; TE only when asked for or needed by fp8.
    use_te = impl == "te" or cfg.dtype == "fp8" or (
        impl == "auto" and cuda and _te_available() and not capture)
    # CUSTOM_QUANT_TYPE on Transformer Engine linears: TE's custom recipe with our quantizer
    # factory (the emulation of megatron-core's local linears does not reach TE's); a TE too
    # old for it is one line naming the version needed.
    te_recipe = use_te and emulation_requested()
    if te_recipe:
        from te_integration.factory import check_te_version, installed_te_version

        check_te_version(installed_te_version())
    quant_type = os.environ.get("CUSTOM_QUANT_TYPE", "").strip()
    if quant_type and emulation_requested() and not te_recipe:
        from .preflight import check_recipe_shape

        check_recipe_shape(quant_type, shape, shape["seq_length"] * cfg.micro_batch_size, tp)
    return {"data_parallel_size": dp, "global_batch_size": gbs,
            "num_micro_batches": gbs // (cfg.micro_batch_size * dp), "shape": shape,
            "use_te": use_te, "te_custom_recipe": te_recipe}


def fp8_overrides(dtype: str, te_custom_recipe: bool) -> dict[str, Any]:
    """TransformerConfig fields of the precision: TE's hybrid FP8 recipe for --dtype fp8; with
    CUSTOM_QUANT_TYPE on TE linears, TE's custom recipe with our factory (any --dtype)."""
    if te_custom_recipe:
        from te_integration.factory import FACTORY_PATH

        return dict(fp8="hybrid", fp8_recipe="custom", fp8_quantizer_factory=FACTORY_PATH)
    if dtype == "fp8":
        return dict(fp8="hybrid", fp8_margin=0, fp8_amax_history_len=1024,
                    fp8_amax_compute_algo="max")
    return {}


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


def train(cfg: TrainConfig, rank: int = 0, world_size: int = 1,
          master_port: int | None = None) -> dict[str, Any]:
    """Run training on this process (one of ``world_size``); returns a summary with the losses.

    Initializes and tears down torch.distributed and megatron's parallel state itself.
    """
    from tensor_capture.config import ENV_TENSORBOARD

    from .capture import SaverHooks, activate_patched_megatron, capture_requested, check_capture_config

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

    import torch

    from . import checkpoint, data, optim, preflight
    from .megatron_env import (LlamaShape, build_llama_model, causal_inputs, cuda_available,
                               destroy_distributed, init_distributed)
    from .tokenizer import load_tokenizer

    cuda = cuda_available()
    derived = check_config(cfg, world_size, cuda, capture)
    tokenizer = load_tokenizer(cfg.tokenizer)
    data.check_data_prefix(cfg.data_path)
    data.check_tokenizer_matches(cfg.data_path, tokenizer)  # before any model is built
    shape_d = derived["shape"]
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    padded_vocab = preflight.padded_vocab_size(tokenizer.vocab_size,
                                               cfg.make_vocab_size_divisible_by, tp)
    if not (cfg.ignore_resource_check or os.environ.get(preflight.CHECKED_ENV)):
        # before the model exists: can this node hold it (and one captured iteration)?
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        preflight.check_training_run(cfg, derived, padded_vocab, ranks,
                                     say=(lambda line: print(f"llama-train: {line}", flush=True))
                                     if rank == 0 else None)
    run_config = {**asdict(cfg), **shape_d, "padded_vocab_size": padded_vocab,
                  "global_batch_size": derived["global_batch_size"],
                  "data_parallel_size": derived["data_parallel_size"]}
    run_config.pop("shape", None)

    init_distributed(rank, world_size, tp, pp, seed=cfg.seed, master_port=master_port)
    log = None
    saver = None
    old_handler = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    except ValueError:  # not the main thread (e.g. inside a test runner thread)
        old_handler = None
    try:
        from megatron.core import parallel_state as ps

        plan = data.BatchPlan(cfg.micro_batch_size, derived["num_micro_batches"],
                              derived["data_parallel_size"], ps.get_data_parallel_rank())
        is_logger = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 \
            and ps.get_data_parallel_rank() == 0
        log = TrainLogger(cfg.log_interval, cfg.tensorboard_dir, cfg.progress_file,
                          enabled=is_logger)
        if rank == 0:
            print(f"llama-train: {cfg.model} model {shape_d}, vocabulary {tokenizer.vocab_size} "
                  f"(padded {padded_vocab}), {world_size} process(es): DP "
                  f"{derived['data_parallel_size']} x TP {tp} x PP {pp}, "
                  f"{'CUDA/nccl' if cuda else 'CPU/gloo'}, dtype {cfg.dtype}, "
                  f"{'Transformer Engine' if derived['use_te'] else 'local'} layers", flush=True)
            if capture:
                print(f"llama-train: tensor capture {'ON via ' + str(patched) if patched else 'requested but the patch set is not installed: training unpatched'}"
                      f" (TENSOR_SAVE_DIR={os.environ.get('TENSOR_SAVE_DIR', '<saver default>')}, "
                      f"CUSTOM_QUANT_TYPE={os.environ.get('CUSTOM_QUANT_TYPE', '<unset>')})", flush=True)

        shape = LlamaShape(vocab_size=padded_vocab, rotary_base=cfg.rotary_base, **shape_d)
        params_dtype = torch.float32 if cfg.dtype == "fp32" else torch.bfloat16
        overrides: dict[str, Any] = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        if pp > 1:
            overrides["pipeline_dtype"] = params_dtype
        overrides.update(fp8_overrides(cfg.dtype, derived["te_custom_recipe"]))
        model = build_llama_model(shape, params_dtype=params_dtype, use_te=derived["use_te"], **overrides)
        if pp == 1:   # a plan rule that matches no GEMM of this model: refused, not ignored
            from .plan_sites import check_plan_covers

            check_plan_covers(model, os.environ.get("CUSTOM_QUANT_PLAN", "").strip())
        if params_dtype != torch.float32:
            model = model.to(params_dtype)   # all of it, norms included, as Megatron's Float16Module
        device = next(model.parameters()).device
        master = optim.MasterParams(model)
        optimizer = optim.build_adamw(master.params, cfg.lr, cfg.weight_decay)

        start = 0
        if cfg.checkpoint_dir and cfg.resume:
            start = checkpoint.load_checkpoint(cfg.checkpoint_dir, model, optimizer, run_config,
                                               RESUME_MUST_MATCH, master=master)
            if start and rank == 0:
                print(f"llama-train: resumed from {cfg.checkpoint_dir} at iteration {start}", flush=True)
        if start >= cfg.train_iters:
            log.say(f"llama-train: checkpoint is already at iteration {start} >= --train-iters "
                    f"{cfg.train_iters}; nothing to do")
            return {"losses": [], "start_iteration": start, "iterations": start}

        dataset = data.build_gpt_dataset(cfg.data_path, tokenizer, shape_d["seq_length"],
                                         cfg.train_iters * plan.global_batch_size, cfg.seed)
        saver = SaverHooks()
        saver.resume_at(start)
        step = _pipeline_step if pp > 1 else _simple_step
        params = master.params
        losses: list[float] = []
        tokens_per_iter = plan.global_batch_size * shape_d["seq_length"]
        for it in range(start, cfg.train_iters):
            t0 = time.perf_counter()
            lr = optim.lr_at(it, cfg.lr, cfg.min_lr, cfg.warmup_iters, cfg.train_iters)
            optim.set_lr(optimizer, lr)
            model.zero_grad(set_to_none=True)
            optimizer.zero_grad(set_to_none=True)
            loss = step(model, dataset, plan, it, device, saver, causal_inputs, shape_d)
            master.grads_to_master()
            optim.average_data_parallel_grads(params)
            norm = optim.grad_norm(params)
            optim.clip_grads(params, cfg.clip_grad, norm)
            optimizer.step()
            master.master_to_model()
            loss = _average_loss_over_dp(loss, device)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            losses.append(loss)
            log.iteration(it, cfg.train_iters, {"loss": loss, "grad_norm": float(norm), "lr": lr,
                                                "tokens_per_s": tokens_per_iter / seconds,
                                                "seconds": seconds})
            diverged, stop = _agree(device, ps.is_pipeline_last_stage() and not math.isfinite(loss),
                                    bool(cfg.stop_file) and os.path.exists(cfg.stop_file))
            if diverged:
                raise UserError(f"the loss is no longer finite at iteration {it + 1}: lower --lr "
                                "or check the data")
            done = it + 1
            if stop and done < cfg.train_iters:
                log.say(f"llama-train: stop requested ({cfg.stop_file}); stopping after "
                        f"iteration {done}")
            exiting = (bool(cfg.exit_interval) and done % cfg.exit_interval == 0) or stop
            if cfg.checkpoint_dir and ((cfg.save_interval and done % cfg.save_interval == 0)
                                       or done == cfg.train_iters or exiting):
                path = checkpoint.save_checkpoint(cfg.checkpoint_dir, done, model, optimizer,
                                                  run_config, master.state())
                log.say(f"llama-train: saved checkpoint {path}")
            if exiting and done < cfg.train_iters:
                if not stop:
                    log.say(f"llama-train: stopping after iteration {done} (--exit-interval)")
                break
        saver.close()
        return {"losses": losses, "start_iteration": start, "iterations": cfg.train_iters,
                "padded_vocab_size": padded_vocab, "capture": saver.active}
    except KeyboardInterrupt:
        if saver is not None:
            with _signals_held():        # a second Ctrl-C (or the collector's SIGTERM) must not
                saver.close()            # cut the flush short: the queued files get written
        where = os.environ.get("TENSOR_SAVE_DIR")
        if rank == 0:
            print("llama-train: interrupted; " + (f"tensors saved so far are complete in {where}"
                  if where and capture else "no tensors were being saved")
                  + (f"; the last checkpoint is in {cfg.checkpoint_dir}" if cfg.checkpoint_dir else ""),
                  file=sys.stderr, flush=True)
        raise
    finally:
        if log is not None:
            log.close()
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
        destroy_distributed()


def _masked_mean(per_token, loss_mask):
    mask = loss_mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def _micro_batch_schedule(*, forward_step_func, data_iterator, model, num_microbatches,
                          forward_only=False, **_unused):
    """The single-stage schedule: forward and backward of each micro-batch in turn, with
    megatron-core's keyword interface (so tensor_saver.wrap_schedule numbers it the same way)."""
    results = []
    for _ in range(num_microbatches):
        out, loss_func = forward_step_func(data_iterator, model)
        loss, reduced = loss_func(out)
        if not forward_only:
            (loss / num_microbatches).backward()
        results.append(reduced)
    return results


def _simple_step(model, dataset, plan, it, device, saver, causal_inputs, shape_d) -> float:
    """Forward and backward of every micro-batch in turn; returns the mean loss."""
    from .data import get_micro_batch

    def forward_step(data_iterator, model_chunk):
        batch = get_micro_batch(dataset, plan, it, next(data_iterator), device)
        tokens = batch["tokens"]
        per_token = model_chunk(tokens, labels=batch["labels"], **causal_inputs(tokens))

        def loss_func(out):
            loss = _masked_mean(out.float(), batch["loss_mask"])
            return loss, float(loss.detach())

        return per_token, loss_func

    losses = saver.wrap_schedule(_micro_batch_schedule)(
        forward_step_func=forward_step, data_iterator=iter(range(plan.num_micro_batches)),
        model=model, num_microbatches=plan.num_micro_batches, forward_only=False)
    return sum(losses) / plan.num_micro_batches


def _pipeline_step(model, dataset, plan, it, device, saver, causal_inputs, shape_d) -> float:
    """Pipeline parallel (CUDA only): megatron-core's 1F1B schedule over the micro-batches."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .data import get_micro_batch

    counter = iter(range(plan.num_micro_batches))

    def forward_step(data_iterator, model_chunk):
        m = next(data_iterator)
        batch = get_micro_batch(dataset, plan, it, m, device)
        tokens = batch["tokens"]
        out = model_chunk(tokens, labels=batch["labels"], **causal_inputs(tokens))

        def loss_func(per_token):
            loss = _masked_mean(per_token.float(), batch["loss_mask"])
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=counter, model=[model],
        num_microbatches=plan.num_micro_batches, seq_length=shape_d["seq_length"],
        micro_batch_size=plan.micro_batch_size, forward_only=False)
    if not results:
        return float("nan")  # not the last stage: the loss lives there
    return float(torch.stack([r["lm loss"] for r in results]).mean())


def _agree(device, *flags: bool) -> tuple[bool, ...]:
    """Each flag true on any rank is true on every rank (so all ranks stop together rather than
    some waiting forever in the next collective)."""
    import torch
    import torch.distributed as dist

    values = [float(f) for f in flags]
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor(values, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        values = t.tolist()
    return tuple(v > 0 for v in values)


def _average_loss_over_dp(loss: float, device) -> float:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size() == 1 or math.isnan(loss):
        return loss
    t = torch.tensor([loss], dtype=torch.float64 if device.type == "cpu" else torch.float32,
                     device=device)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t.item()) / ps.get_data_parallel_world_size()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llama-train",
        description="Train a Llama-style GPT on megatron-core (CPU gloo or CUDA nccl). Set "
                    "TENSOR_SAVE_ENABLED=true and CUSTOM_QUANT_TYPE to capture tensors through "
                    "the patched megatron-core. Launch several processes with torchrun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
                   help="ignore an existing checkpoint in --checkpoint-dir")
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


@cli_entry("llama-train")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
