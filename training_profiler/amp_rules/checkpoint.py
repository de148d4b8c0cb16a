"""A checkpoint that keeps the optimizer's state but not the GradScaler's (AMP018): a bug kind
public projects fixed."""
from __future__ import annotations

import ast
import re

from training_profiler import amp_values as av
from training_profiler.amp_context import FileContext, dotted
from training_profiler.amp_rules.base import Rule, RuleVisitor, Severity, declare_rule
from training_profiler.amp_rules.helpers import _callee, _has_kw


# ---- AMP018: the GradScaler's state left out of a checkpoint -------------------------------------
def _scalerish(ctx: FileContext, expr: ast.AST) -> bool:
    """Something of the loss scaler: a GradScaler (by value or name), apex's ``amp`` state, a key
    naming one."""
    return any((isinstance(n, ast.Constant) and isinstance(n.value, str) and re.search(r"scaler|loss_scale|amp", n.value))
               or (isinstance(n, (ast.Name, ast.Attribute)) and (re.search(r"scaler|loss_scale|(^|\.)amp$", dotted(n) or "", re.I)
                                                               or av.SCALER in ctx.values.kinds(n)))
               for n in ast.walk(expr))


def _optimizer_state(ctx: FileContext, expr: ast.AST) -> bool:
    """``optimizer.state_dict()`` (by value or name) somewhere in ``expr``."""
    for n in ast.walk(expr):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "state_dict":
            r = n.func.value
            if av.OPTIMIZER in ctx.values.kinds(r) or "optim" in (dotted(r) or "").lower():
                return True
    return False


def _saved_dict(ctx: FileContext, call: ast.Call) -> list[ast.AST]:
    """What a ``torch.save(obj, ...)`` saves: the dict literal, or a name bound to one plus the
    ``obj[key] = value`` stores into it in the same function."""
    if not call.args:
        return []
    obj = call.args[0]
    if isinstance(obj, ast.Dict):
        return [obj]
    if not isinstance(obj, ast.Name):
        return []
    fn = ctx.enclosing_function(call)
    out: list[ast.AST] = []
    for st in ast.walk(fn):
        if isinstance(st, ast.Assign):
            for t in st.targets:
                if (isinstance(t, ast.Name) and t.id == obj.id) or (
                        isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == obj.id):
                    out += [t, st.value]
    return out


def _module_saves_scaler(ctx: FileContext) -> bool:
    return any(isinstance(c.func, ast.Attribute) and c.func.attr == "state_dict" and _scalerish(ctx, c.func.value)
               for c in ctx.calls)


@declare_rule(
    "AMP018", "scaler-state-not-checkpointed", Severity.LOW,
    explanation=(
        "A checkpoint that keeps the optimizer but not the GradScaler's state resumes a float16 run "
        "from the initial loss scale (65536): the first steps overflow and are skipped, and a scale "
        "that had grown or shrunk for this model is lost."),
    suggestion=(
        "Save scaler.state_dict() beside the optimizer's state and load it with scaler.load_state_dict()."))
class ScalerStateNotCheckpointed(RuleVisitor):
    """A function that checkpoints the optimizer's state (``torch.save`` of a dict holding it, a
    ``save_*`` call given it, a Checkpointer given ``optimizer=``) and nothing of the GradScaler,
    in code whose training uses one."""

    def run(self):
        ctx = self.ctx
        if not (ctx.has_gradscaler or any(m.has_gradscaler for m in ctx.project.users_of(ctx))):
            return self.hits
        if _module_saves_scaler(ctx):
            return self.hits
        by_fn: dict[ast.AST, list[ast.Call]] = {}
        for c in ctx.calls:
            by_fn.setdefault(ctx.enclosing_function(c), []).append(c)
        for fn, calls in by_fn.items():
            saves = sorted((c for c in calls if self._saves_optimizer(c)), key=lambda c: (c.lineno, c.col_offset))
            if saves and not any(_scalerish(ctx, a) for c in saves for a in [*c.args, *(k.value for k in c.keywords)]):
                c = saves[0]
                callee = _callee(ctx, c)
                what = f"{callee} is given the optimizer" if "Checkpoint" in callee else "checkpoint saves the optimizer's state"
                self.report(c, f"{what} but not the GradScaler's")
        return self.hits

    def _saves_optimizer(self, c: ast.Call) -> bool:
        ctx = self.ctx
        callee = _callee(ctx, c)
        if "Checkpoint" in callee and callee[:1].isupper():
            return _has_kw(c, "optimizer")
        if "save" not in callee.lower():
            return False
        parts = _saved_dict(ctx, c) or [*c.args, *(k.value for k in c.keywords)]
        return any(_optimizer_state(ctx, p) for p in parts) and not any(_scalerish(ctx, p) for p in parts)


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (ScalerStateNotCheckpointed.rule,)
