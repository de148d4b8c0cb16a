"""What runs inside and outside an autocast block: an op autocast refuses (AMP002), a loss
computed after the block on its low-precision outputs (AMP003, training and evaluation), a
backward inside it (AMP009), a forward wrapped in it (AMP014)."""
from __future__ import annotations

import ast

from quant.vocabulary import Severity
from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.context import FileContext
from training_profiler.amp_checker.intent import (
    float32_result,
    is_float32_cast,
    no_grad_region,
    training_backward_calls,
)
from training_profiler.amp_checker.rules.base import Confidence, Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import _is_accelerator, _is_loss_call

_BCE = {"torch.nn.functional.binary_cross_entropy", "torch.binary_cross_entropy",
        "torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss"}


@declare_rule(
    "AMP002", "bce-under-autocast", Severity.HIGH,
    explanation=(
        "binary_cross_entropy / BCELoss is unsafe under CUDA autocast (PyTorch raises an error): "
        "the log of a float16 probability saturates."),
    suggestion="Use binary_cross_entropy_with_logits / BCEWithLogitsLoss on the raw logits.")
class BceUnderAutocast(RuleVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        if (ctx.uses_amp or ctx.library_amp or ctx.project_uses_amp) and not ctx.cpu_only_autocast \
                and ctx.call_name(node) in _BCE:
            scope = ctx.scope_of(node)
            if scope is None or scope.enabled:
                name = ctx.call_name(node).split(".")[-1]
                self.report(node, f"{name} usage in AMP code")
        self.generic_visit(node)


def _produced_names(ctx: FileContext, stmt: ast.AST) -> set[str]:
    """Names an autocast block leaves holding low-precision results: assigned from calls or
    arithmetic inside it, except losses (autocast computes those in float32)."""
    out: set[str] = set()
    for n in ast.walk(stmt):
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and isinstance(
                getattr(n, "value", None), (ast.Call, ast.BinOp)):
            if isinstance(n.value, ast.Call) and (_is_loss_call(ctx, n.value) or float32_result(ctx, n.value)):
                continue
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for x in ast.walk(t):
                    if isinstance(x, ast.Name):
                        out.add(x.id)
    return out


def _lowp_names_in(ctx: FileContext, expr: ast.AST, names: set[str]) -> set[str]:
    """Which of ``names`` reach ``expr`` without passing through a float32 cast first
    (``logits.float()`` hands the loss a float32 tensor)."""
    if is_float32_cast(ctx, expr):
        return set()
    if isinstance(expr, ast.Name):
        return {expr.id} & names
    out: set[str] = set()
    for child in ast.iter_child_nodes(expr):
        out |= _lowp_names_in(ctx, child, names)
    return out


def _statement_lists(tree: ast.AST):
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                yield stmts


@declare_rule(
    "AMP003", "loss-outside-autocast", Severity.HIGH, training_path=True,
    explanation=(
        "The loss is computed outside the autocast block on its low-precision outputs, so it runs "
        "in float16/bfloat16 instead of autocast's float32 loss kernels (type mismatch, lost precision)."),
    suggestion=(
        "Compute the loss inside the `with autocast(...)` block, or cast the outputs with .float() first."))
class LossOutsideAutocast(RuleVisitor):
    def run(self):
        ctx = self.ctx
        for stmts in _statement_lists(ctx.tree):
            produced: set[str] = set()
            for stmt in stmts:
                if isinstance(stmt, (ast.With, ast.AsyncWith)) and any(
                        (s := ctx.with_scope(i.context_expr)) is not None and s.enabled
                        for i in stmt.items):
                    produced |= _produced_names(ctx, stmt)
                    continue
                if not produced:
                    continue
                for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                    if ctx.in_autocast(call) or not self._judged(call) or not _is_loss_call(ctx, call):
                        continue
                    used: set[str] = set()
                    for a in [*call.args, *(k.value for k in call.keywords)]:
                        used |= _lowp_names_in(ctx, a, produced)
                    if used:
                        self._say(call, (ctx.call_name(call) or "loss").split(".")[-1])
        self._prepared_model_losses()
        return self.hits

    def _judged(self, call: ast.Call) -> bool:
        """Under no_grad the loss is a metric, not a training signal (see EvalLossOutsideAutocast)."""
        return not no_grad_region(self.ctx, call)

    def _say(self, call: ast.Call, name: str) -> None:
        self.report(call, f"loss `{name}(...)` computed outside the autocast block")

    def _prepared_model_losses(self) -> None:
        """Accelerate in mixed precision runs a prepared model's forward under autocast (and
        DeepSpeed keeps its weights in float16): a torch loss on its raw output, not cast to
        float32, runs in low precision."""
        ctx = self.ctx
        if not any((ctx.call_name(c) or "").startswith("accelerate") for c in ctx.calls):
            return
        for fn in [ctx.tree, *(n for n in ctx.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
            prepared: set[str] = set()
            produced: set[str] = set()
            body = sorted((n for n in _own_statements(fn)), key=lambda n: (n.lineno, n.col_offset))
            for st in body:
                if isinstance(st, ast.Assign) and isinstance(st.value, ast.Call):
                    f = st.value.func
                    if isinstance(f, ast.Attribute) and f.attr == "prepare" and _is_accelerator(ctx, f.value):
                        prepared |= {n.id for t in st.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                        continue
                has_loss = False
                for call in (n for n in ast.walk(st) if isinstance(n, ast.Call)):
                    q = ctx.call_name(call) or ""
                    if not (av.is_torch_loss_function(q) or any(v.kind == av.LOSS for v in ctx.values.value(call))):
                        continue
                    has_loss = True
                    if not produced or ctx.in_autocast(call) or no_grad_region(ctx, call):
                        continue
                    used: set[str] = set()
                    for a in [*call.args, *(k.value for k in call.keywords)]:
                        used |= _lowp_names_in(ctx, a, produced)
                    if used:
                        self.report(call, f"loss `{q.rsplit('.', 1)[-1]}(...)` on the raw output of a model "
                                          f"Accelerate prepares in mixed precision (`{sorted(used)[0]}` not cast "
                                          "to float32: float16 under DeepSpeed, set by `accelerate config` "
                                          "outside the code: unknown)", Confidence.MEDIUM)
                if isinstance(st, ast.Assign) and not has_loss:  # a loss's value is computed in float32 by it
                    called = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in prepared
                                 for c in ast.walk(st.value))
                    if called or _lowp_names_in(ctx, st.value, produced):
                        produced |= {n.id for t in st.targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _own_statements(fn: ast.AST):
    """Simple statements of a function (or module) body, not of nested functions or classes."""
    stack = list(fn.body) if hasattr(fn, "body") else []
    while stack:
        st = stack.pop()
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)):
            yield st
        for field in ("body", "orelse", "finalbody", "handlers"):
            stack.extend(getattr(st, field, []) or [])


# ---- AMP003: an evaluation loss after the block ------------------------------------------------
class EvalLossOutsideAutocast(LossOutsideAutocast):
    """A validation loss computed after the autocast block (entered through a ``partial`` bound
    elsewhere, as timm-style ``validate(..., amp_autocast=...)`` does) on its low-precision
    outputs: not a training signal, but the metric that picks checkpoints and stops early is
    computed in float16 (MEDIUM)."""

    def _judged(self, call: ast.Call) -> bool:
        return no_grad_region(self.ctx, call)

    def _say(self, call: ast.Call, name: str) -> None:
        self.report(call, f"evaluation loss `{name}(...)` computed outside the autocast block, in its "
                          "low precision", Confidence.MEDIUM)

    def _prepared_model_losses(self) -> None:
        return None


@declare_rule(
    "AMP009", "backward-inside-autocast", Severity.LOW, training_path=True,
    explanation=(
        "Backward passes under autocast are not recommended: backward ops already run in the "
        "dtype autocast chose for the matching forward op."),
    suggestion="Leave the `with autocast(...)` block before calling loss.backward().")
class BackwardInAutocast(RuleVisitor):
    def run(self):
        for call in training_backward_calls(self.ctx):
            if self.ctx.in_autocast(call):
                self.report(call, "backward() called inside the autocast block")
        return self.hits


@declare_rule(
    "AMP014", "autocast-wrapped-forward", Severity.MEDIUM, training_path=True,
    explanation=(
        "Wrapping a model's forward in autocast returns its float16/bfloat16 outputs to code "
        "outside autocast: a loss computed there runs in low precision."),
    suggestion="Convert the wrapped forward's outputs to float32 (or compute the loss under autocast).")
class AutocastWrappedForward(RuleVisitor):
    """``model.forward = autocast(...)(model.forward)``: the outputs leave autocast in its low
    precision, so a loss written outside the model runs in float16/bfloat16."""

    def visit_Assign(self, node: ast.Assign) -> None:
        v = node.value
        if (isinstance(v, ast.Call) and v.args and isinstance(v.func, ast.Call)
                and any(isinstance(t, ast.Attribute) and t.attr == "forward" for t in node.targets)
                and any(x.kind == av.AUTOCAST for x in self.ctx.values.value(v.func))):
            self.report(v, "forward wrapped in autocast hands low-precision outputs to the caller")
        self.generic_visit(node)


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (
    BceUnderAutocast.rule,
    LossOutsideAutocast.rule,
    BackwardInAutocast.rule,
    AutocastWrappedForward.rule,
)
