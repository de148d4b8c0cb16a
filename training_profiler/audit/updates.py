"""Parameter updates written by hand, judged for lost updates as optimizer steps are.

A training loop that updates its parameters itself (``p.data.add_(p.grad, alpha=-lr)``,
``p -= lr * p.grad`` under ``no_grad``, ``torch._foreach_add_(params, grads, alpha=-lr)``, an EMA's
``mul_`` / ``lerp_``) calls no optimizer, so the step hooks never see it; with bfloat16 or float16
parameters every update below half an ulp of the weight rounds away there just the same. The
recorder hands each in-place update op whose target is a low-precision parameter to
:class:`UpdateJudge`, which computes the same update in float32 on copies first (what float32
master weights, the fix, would keep) and then runs the op as asked: an element the float32 update
moves and the real one leaves as it was is a lost update. Pure overwrites (``copy_`` from float32 master weights) are
not updates and are not judged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from training_profiler.audit.source import LOW_PRECISION, Origins, Where, dtype_name, user_frame

#: in-place ops that move a tensor relative to its value (an update), their foreach forms included
UPDATE_OPS = frozenset({
    "add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_", "lerp_",
    "_foreach_add_", "_foreach_sub_", "_foreach_mul_", "_foreach_div_", "_foreach_addcmul_",
    "_foreach_addcdiv_", "_foreach_lerp_"})
_FOREACH = "_foreach_"


@dataclass
class ManualUpdate:
    """One call site of one hand-written update op, aggregated over its calls."""

    where: Where
    op: str
    param_dtypes: set[str] = field(default_factory=set)
    casts: dict[Where, str] = field(default_factory=dict)   # where its parameters were cast
    calls: int = 0
    moved_elems: int = 0            # elements the float32 update changes
    stuck_elems: int = 0            # ... and the real update left unchanged


def _float32(obj: Any) -> Any:
    """Float32 copies of the floating tensors in ``obj`` (an argument; lists item by item)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(torch.float32, copy=True) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_float32(o) for o in obj)
    return obj


def float32_update(func: Any, op: str, args: tuple, kwargs: dict, index: int | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target (item ``index`` of a foreach op's list) before and after the update, both in
    float32, computed on copies; the arguments are left as they were."""
    if index is not None:   # a foreach op: its per-tensor op on item ``index`` of every list
        func = getattr(torch.ops.aten, op[len(_FOREACH):])
        args = tuple(a[index] if isinstance(a, (list, tuple)) else a for a in args)
    args32, kwargs32 = _float32(args), {k: _float32(v) for k, v in kwargs.items()}
    before = args32[0].clone()
    func(*args32, **kwargs32)
    return before, args32[0]


class UpdateJudge:
    """Finds the low-precision parameters an in-place update targets and judges the update;
    ``paused`` while an optimizer step runs (the step hooks judge those)."""

    def __init__(self, origins: Origins, updates: dict[tuple, ManualUpdate]) -> None:
        self.origins = origins
        self.updates = updates
        self.paused = False
        self.pending = False         # an update judged since the last backward started

    def targets(self, args: tuple) -> list[tuple[int | None, torch.Tensor, torch.Tensor]]:
        """(list index or None, target tensor, its parameter) for each low-precision parameter
        the op updates in place."""
        if self.paused or not args:
            return []
        first = args[0]
        listed = isinstance(first, (list, tuple))
        out = []
        for i, t in enumerate(first if listed else (first,)):
            if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION:
                p = self.origins.param_of(t)
                if p is not None:
                    out.append((i if listed else None, t, p))
        return out

    def run(self, func: Any, op: str, args: tuple, kwargs: dict,
            targets: list[tuple[int | None, torch.Tensor, torch.Tensor]]) -> Any:
        """Run the op as asked; count the elements its float32 form moves and it did not."""
        snaps = []
        for index, t, p in targets:
            try:
                before, after = float32_update(func, op, args, kwargs, index)
            except (RuntimeError, TypeError):   # a form with no per-tensor twin: not judged
                continue
            snaps.append((t, p, before, after != before))
        out = func(*args, **kwargs)
        if not snaps:
            return out
        where = user_frame(2)
        site = self.updates.get((op, where))
        if site is None:
            site = self.updates[(op, where)] = ManualUpdate(where, op)
        site.calls += 1
        self.pending = True
        for t, p, before, moved in snaps:
            site.param_dtypes.add(dtype_name(t.dtype))
            cast = self.origins.casts.get(p)
            if cast is not None and cast[1] == dtype_name(t.dtype):
                site.casts.setdefault(*cast)
            site.moved_elems += int(moved.sum())
            site.stuck_elems += int((moved & (t.detach() == before)).sum())  # exact: t widens
        return out
