"""A checkpoint that keeps the optimizer's state but not the GradScaler's (AMP018): a bug kind
public projects fixed."""
from __future__ import annotations

import ast
import re

from quant.vocabulary import Severity
from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import per_project
from training_profiler.amp_checker.rules.base import Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import _callee, _has_kw


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


def _is_optimizer(ctx: FileContext, expr: ast.AST) -> bool:
    """The optimizer object itself (``save_checkpoint(model, optimizer, ...)``: the helper saves
    its state), by value or by name."""
    if not isinstance(expr, (ast.Name, ast.Attribute)):
        return False
    name = (dotted(expr) or "").rsplit(".", 1)[-1].lower()
    return av.OPTIMIZER in ctx.values.kinds(expr) or name in ("optimizer", "optim", "opt") or name.startswith("optimizer_")


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


@per_project
def _project_saves_scaler(ctx: FileContext) -> bool:
    """Some module of the scan saves a loss scaler's state: a framework whose save helpers take
    the optimizer (Megatron, Accelerate) saves the scaler through another path, so a helper given
    the optimizer alone says nothing there."""
    return any(_module_saves_scaler(m) or _save_calls_given_a_scaler(m) for m in ctx.project.program_modules(ctx))


def _save_calls_given_a_scaler(ctx: FileContext) -> set[str]:
    """Names of the save helpers this module hands the scaler (object or state)."""
    return {_callee(ctx, c) for c in ctx.calls if "save" in _callee(ctx, c).lower()
            and any(_scalerish(ctx, a) for a in [*c.args, *(k.value for k in c.keywords)])}


@per_project
def _helpers_given_a_scaler(ctx: FileContext) -> set[str]:
    """Save helpers the program hands a scaler somewhere: one called without it here leaves the
    scaler out where the other training scripts put it in (Coqui TTS's vocoder scripts)."""
    return set().union(*(_save_calls_given_a_scaler(m) for m in ctx.project.program_modules(ctx)))


def _module_saves_scaler(ctx: FileContext) -> bool:
    return any(isinstance(c.func, ast.Attribute) and c.func.attr == "state_dict" and _scalerish(ctx, c.func.value)
               for c in ctx.calls)


@declare_rule(
    "AMP018", "scaler-state-not-checkpointed", Severity.LOW, training_path=True,
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
            saves = sorted(((c, what) for c in calls if (what := self._saves_optimizer(c))),
                           key=lambda cw: (cw[0].lineno, cw[0].col_offset))
            if saves and not any(_scalerish(ctx, a) for c, _ in saves for a in [*c.args, *(k.value for k in c.keywords)]):
                c, what = saves[0]
                self.report(c, what)
        return self.hits

    def _saves_optimizer(self, c: ast.Call) -> str | None:
        """What ``c`` does with the optimizer and leaves the scaler out of (the finding's text),
        or None: a Checkpointer given ``optimizer=``, a save of its state, or a save helper given
        the optimizer object itself (only where the scan saves no scaler state, or hands this
        very helper the scaler elsewhere)."""
        ctx = self.ctx
        callee = _callee(ctx, c)
        if "Checkpoint" in callee and callee[:1].isupper():
            return f"{callee} is given the optimizer but not the GradScaler" if _has_kw(c, "optimizer") else None
        if "save" not in callee.lower():
            return None
        given = [*c.args, *(k.value for k in c.keywords)]
        saved = _saved_dict(ctx, c)
        parts = saved or given
        if any(_scalerish(ctx, p) for p in parts):
            return None
        if any(_optimizer_state(ctx, p) for p in parts):
            return "checkpoint saves the optimizer's state but not the GradScaler's"
        if not saved and callee != "save" and any(_is_optimizer(ctx, p) for p in given) \
                and (callee in _helpers_given_a_scaler(ctx) or not _project_saves_scaler(ctx)):
            return f"{callee} is given the optimizer but not the GradScaler"
        return None


class ScalerSaveNeverRuns(RuleVisitor):
    """AMP018 where the GradScaler's state is saved only under a test that its key is already in
    the dict this very function builds without it (``checkpoint = {...}`` ... ``if amp and
    'amp_scaling_state' in checkpoint: checkpoint['amp_scaling_state'] = scaler.state_dict()``):
    the condition copied from the restore path is never true, so the loss scale is never saved
    (Lightning's checkpoint dump)."""

    def visit_If(self, node: ast.If) -> None:
        ctx = self.ctx
        for key, holder in _membership_tests(node.test):
            store = next((st for st in node.body if _stores_scaler_state(ctx, st, holder, key)), None)
            if store is not None and _built_here_without(ctx, node, holder, key):
                self.report(store, f"the GradScaler's state is saved only when {key!r} is already in "
                                   f"`{holder}`, which this function builds without it: the save never runs")
        self.generic_visit(node)


def _membership_tests(test: ast.AST) -> list[tuple[str, str]]:
    """``'key' in name`` conjuncts of a condition (all of an ``and``, or the test itself)."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    return [(p.left.value, p.comparators[0].id) for p in parts
            if isinstance(p, ast.Compare) and len(p.ops) == 1 and isinstance(p.ops[0], ast.In)
            and isinstance(p.left, ast.Constant) and isinstance(p.left.value, str)
            and isinstance(p.comparators[0], ast.Name)]


def _subscript_of(target: ast.AST, holder: str) -> ast.AST | None:
    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == holder:
        return target.slice
    return None


def _stores_scaler_state(ctx: FileContext, st: ast.AST, holder: str, key: str) -> bool:
    """``holder[key] = <scaler>.state_dict()``."""
    return (isinstance(st, ast.Assign) and any(
        isinstance(k := _subscript_of(t, holder), ast.Constant) and k.value == key for t in st.targets)
        and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute)
        and st.value.func.attr == "state_dict" and _scalerish(ctx, st.value.func.value))


def _built_here_without(ctx: FileContext, test: ast.If, holder: str, key: str) -> bool:
    """``holder`` is bound once in the function, before ``test``, to a dict display without
    ``key``, and nothing before ``test`` can add it: no store of that key or of a computed key,
    no ``update``/``setdefault``, no call that is handed the dict, no loop around the test."""
    fn = ctx.enclosing_function(test)
    if fn is ctx.tree:
        return False
    cur = ctx.parents.get(test)
    while cur is not None and cur is not fn:
        if isinstance(cur, (ast.For, ast.AsyncFor, ast.While)):
            return False
        cur = ctx.parents.get(cur)
    binds = [st for st in ast.walk(fn) if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign))
             and any(isinstance(t, ast.Name) and t.id == holder
                     for t in (st.targets if isinstance(st, ast.Assign) else [st.target]))]
    if len(binds) != 1 or not isinstance(binds[0], ast.Assign) or binds[0].lineno >= test.lineno:
        return False
    made = binds[0].value
    if not isinstance(made, ast.Dict) or any(k is None or not isinstance(k, ast.Constant) or k.value == key
                                            for k in made.keys):
        return False
    for n in ast.walk(fn):
        if not (binds[0].lineno < getattr(n, "lineno", 0) < test.lineno):
            continue
        k = _subscript_of(n, holder)
        if isinstance(ctx.parents.get(n), (ast.Assign, ast.AugAssign)) and k is not None and (
                not isinstance(k, ast.Constant) or k.value == key):
            return False
        if isinstance(n, ast.Call) and (any(isinstance(a, ast.Name) and a.id == holder
                                            for a in [*n.args, *(kw.value for kw in n.keywords)])
                                        or isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                                        and n.func.value.id == holder and n.func.attr != "get"):
            return False
    return True


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (ScalerStateNotCheckpointed.rule,)
