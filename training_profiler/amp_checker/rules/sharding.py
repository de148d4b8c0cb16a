"""AMP027: a plain GradScaler for a model that FSDP shards.

Under FSDP (``FullyShardedDataParallel``) each rank holds a shard of every gradient. A plain
``GradScaler`` checks only the local shard for inf/NaN: the rank whose shard overflowed skips
``optimizer.step()`` and halves its scale, the others step, and the replicas drift apart from
then on. torch's ``ShardedGradScaler`` (fairscale has one too) all-reduces that check across
ranks and also handles CPU-offloaded gradients (composer used the plain one with FSDP until
2022).
"""
from __future__ import annotations

import ast

from quant.vocabulary import Severity
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import per_project
from training_profiler.amp_checker.rules.base import Confidence, Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import plain_torch_scalers
from training_profiler.amp_checker.values import FUNCTION

_FSDP = "FullyShardedDataParallel"
_SHARDED = "ShardedGradScaler"


def _wraps_fsdp(ctx: FileContext, nodes) -> ast.Call | None:
    """The first ``FullyShardedDataParallel(...)`` call among ``nodes``."""
    return next((c for c in nodes if isinstance(c, ast.Call)
                 and (ctx.qualname(c.func) or dotted(c.func) or "").endswith(_FSDP)), None)


@per_project
def _project_facts(ctx: FileContext) -> tuple[bool, list[FileContext]]:
    """(a ShardedGradScaler is named anywhere in the program, the modules that wrap with FSDP)."""
    modules = ctx.project.program_modules(ctx)
    sharded = any(((isinstance(n, (ast.Name, ast.Attribute)) and (m.qualname(n) or "").endswith(_SHARDED))
                   or (isinstance(n, ast.ImportFrom) and any(a.name == _SHARDED for a in n.names)))
                  for m in modules for n in m.nodes)
    wrapping = [m for m in modules if _wraps_fsdp(m, m.calls) is not None]
    return sharded, wrapping


@declare_rule(
    "AMP027", "gradscaler-not-sharded", Severity.MEDIUM, training_path=True,
    explanation=("A plain GradScaler checks only this rank's gradients for inf/NaN. Under FSDP each rank holds "
                 "a shard of every gradient, so the rank whose shard overflowed skips the step and halves its "
                 "scale while the others step: the replicas drift apart."),
    suggestion=("Use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler with FSDP: it all-reduces "
                "the inf/NaN check across ranks (and handles CPU-offloaded gradients)."))
class GradScalerNotSharded(RuleVisitor):
    """A ``torch.amp.GradScaler(...)`` made in a module that wraps the model in FSDP (itself,
    or through a project function it calls; medium when another module of the same program
    does), in a scan that names no ShardedGradScaler. A separate script that uses FSDP (an
    examples folder) says nothing about this one."""

    def run(self):
        ctx = self.ctx
        plain = plain_torch_scalers(ctx)
        if not plain:
            return self.hits
        sharded, wrapping = _project_facts(ctx)
        if sharded or not wrapping:
            return self.hits
        where, confidence = self._fsdp_here(), Confidence.HIGH
        if where is None:  # FSDP in the same program (a module this one uses, or that uses it), not beside it
            users = {id(m) for m in ctx.project.users_of(ctx)}
            other = next((m for m in wrapping if id(m) in users or any(u is ctx for u in ctx.project.users_of(m))),
                         None)
            if other is None:
                return self.hits
            where = f"{other.path.rsplit('/', 1)[-1]}:{_wraps_fsdp(other, other.calls).lineno}"
            confidence = Confidence.MEDIUM
        for c in plain:
            self.report(c, f"a plain GradScaler where FSDP shards the model ({where}): each rank checks only its "
                           "own gradient shard for inf/NaN, so ranks can disagree on skipping a step", confidence)
        return self.hits

    def _fsdp_here(self) -> str | None:
        """Where this module wraps with FSDP: a call of its own, or of a project function that
        makes one (``prepare_fsdp_module(model, ...)``)."""
        ctx = self.ctx
        own = _wraps_fsdp(ctx, ctx.calls)
        if own is not None:
            return f"line {own.lineno}"
        for c in ctx.calls:
            for v in ctx.values.value(c.func):
                if v.kind == FUNCTION and v.ctx is not None and _wraps_fsdp(v.ctx, ast.walk(v.node)) is not None:
                    return f"through {getattr(v.node, 'name', '?')}() at line {c.lineno}"
        return None


RULES: tuple[Rule, ...] = (GradScalerNotSharded.rule,)
