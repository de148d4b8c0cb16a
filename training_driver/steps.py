"""One training iteration's forward and backward passes, and the facts the ranks agree on.

Kept apart from the loop (``training_driver.train``) because other drivers run the same
iteration: ``attribution.runner`` trains its what-if variants with :func:`simple_step`, so a
run there and under llama-train see the same micro-batch schedule and the same numbers.
"""
from __future__ import annotations


def masked_mean(per_token, loss_mask):
    mask = loss_mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def micro_batch_schedule(*, forward_step_func, data_iterator, model, num_microbatches,
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


def simple_step(model, dataset, plan, it, device, saver, causal_inputs, shape_d) -> float:
    """Forward and backward of every micro-batch in turn; returns the mean loss."""
    from .data.samples import get_micro_batch

    def forward_step(data_iterator, model_chunk):
        batch = get_micro_batch(dataset, plan, it, next(data_iterator), device)
        tokens = batch["tokens"]
        per_token = model_chunk(tokens, labels=batch["labels"], **causal_inputs(tokens))

        def loss_func(out):
            loss = masked_mean(out.float(), batch["loss_mask"])
            return loss, float(loss.detach())

        return per_token, loss_func

    losses = saver.wrap_schedule(micro_batch_schedule)(
        forward_step_func=forward_step, data_iterator=iter(range(plan.num_micro_batches)),
        model=model, num_microbatches=plan.num_micro_batches, forward_only=False)
    return sum(losses) / plan.num_micro_batches


def pipeline_step(model, dataset, plan, it, device, saver, causal_inputs, shape_d) -> float:
    """Pipeline parallel (CUDA only): megatron-core's 1F1B schedule over the micro-batches."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .data.samples import get_micro_batch

    counter = iter(range(plan.num_micro_batches))

    def forward_step(data_iterator, model_chunk):
        m = next(data_iterator)
        batch = get_micro_batch(dataset, plan, it, m, device)
        tokens = batch["tokens"]
        out = model_chunk(tokens, labels=batch["labels"], **causal_inputs(tokens))

        def loss_func(per_token):
            loss = masked_mean(per_token.float(), batch["loss_mask"])
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=counter, model=[model],
        num_microbatches=plan.num_micro_batches, seq_length=shape_d["seq_length"],
        micro_batch_size=plan.micro_batch_size, forward_only=False)
    if not results:
        return float("nan")  # not the last stage: the loss lives there
    return float(torch.stack([r["lm loss"] for r in results]).mean())


def agree(device, *flags: bool) -> tuple[bool, ...]:
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


def average_loss_over_dp(loss: float, device) -> float:
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    # not the last pipeline stage: no loss here (NaN on every rank of the stage alike); a NaN
    # loss of one replica still joins the all-reduce, or its peers would wait for it forever
    if ps.get_data_parallel_world_size() == 1 or not ps.is_pipeline_last_stage():
        return loss
    t = torch.tensor([loss], dtype=torch.float64 if device.type == "cpu" else torch.float32,
                     device=device)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t.item()) / ps.get_data_parallel_world_size()
