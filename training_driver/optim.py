"""Optimizer pieces of the training loop: AdamW groups, warmup + cosine LR, DP grad averaging,
model-parallel-aware gradient norm and clipping.

Written out (rather than megatron's DDP + DistributedOptimizer) because those allocate on CUDA
unconditionally; these few functions run the same on gloo/CPU and nccl/CUDA.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist


def lr_at(iteration: int, max_lr: float, min_lr: float, warmup_iters: int, total_iters: int) -> float:
    """Learning rate for 0-based ``iteration``: linear warmup to max_lr, cosine decay to min_lr."""
    if warmup_iters > 0 and iteration < warmup_iters:
        return max_lr * (iteration + 1) / warmup_iters
    decay_iters = max(1, total_iters - warmup_iters)
    progress = min(1.0, (iteration - warmup_iters) / decay_iters)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class MasterParams:
    """fp32 master copies of low-precision (bf16) model parameters, the optimizer's view.

    Megatron's linear layers are custom autograd functions that autocast does not reach, so bf16
    training keeps the model in bf16 and the optimizer on fp32 copies: gradients go model ->
    master before the step, values go master -> model after it. For an fp32 model the master
    parameters are the model's own (no copies).
    """

    def __init__(self, model: torch.nn.Module):
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.copies = any(p.dtype != torch.float32 for p in self.model_params)
        if not self.copies:
            self.params = self.model_params
            return
        self.params = []
        for p in self.model_params:
            m = p.detach().float().clone().requires_grad_(True)
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(p, attr):
                    setattr(m, attr, getattr(p, attr))
            self.params.append(m)

    def grads_to_master(self) -> None:
        if self.copies:
            for p, m in zip(self.model_params, self.params):
                m.grad = None if p.grad is None else p.grad.float()

    def master_to_model(self) -> None:
        if self.copies:
            with torch.no_grad():
                for p, m in zip(self.model_params, self.params):
                    p.copy_(m)

    def state(self) -> list[torch.Tensor]:
        return [m.detach() for m in self.params] if self.copies else []

    def load_state(self, tensors: list[torch.Tensor]) -> None:
        if self.copies:
            with torch.no_grad():
                for m, t in zip(self.params, tensors):
                    m.copy_(t)
            self.master_to_model()


def build_adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                betas=(0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW with no weight decay on 1-D parameters (norm scales, biases), as is usual for GPTs."""
    decay, no_decay = [], []
    for p in params:
        (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def average_data_parallel_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """All-reduce gradients over the data-parallel group and divide by its size."""
    from megatron.core import parallel_state

    world = parallel_state.get_data_parallel_world_size()
    if world == 1:
        return
    group = parallel_state.get_data_parallel_group()
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients of the whole model, counted once per parameter.

    Tensor-parallel duplicates (norm scales replicated on every TP rank) are counted on TP rank 0
    only; the sum of squares is all-reduced over the model-parallel (TP x PP) group.
    """
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from megatron.core import parallel_state

    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            total += p.grad.detach().float().pow(2).sum()
    if parallel_state.get_model_parallel_group() is not None and dist.is_initialized():
        mp_world = dist.get_world_size(group=parallel_state.get_model_parallel_group())
        if mp_world > 1:
            dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return total.sqrt()


def clip_grads(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (no-op when max_norm <= 0)."""
    if max_norm <= 0:
        return
    coef = max_norm / (float(total_norm) + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
