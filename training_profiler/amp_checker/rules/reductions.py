"""Softmax and sums in the input's low precision: a softmax without ``dtype=`` (AMP004, also
when the float32 copies made for it go unused) and a sum/mean of a low-precision tensor outside
autocast (AMP005)."""
from __future__ import annotations

import ast

from quant.vocabulary import Severity
from training_profiler.amp_checker.context import FileContext
from training_profiler.amp_checker.intent import (
    float32_result,
    is_float32_cast,
    training_lowp_casts,
)
from training_profiler.amp_checker.rules.base import Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import _accelerate_autocast, _has_kw, _is_loss_call

_SOFTMAX = {"torch.softmax", "torch.log_softmax", "torch.nn.functional.softmax",
            "torch.nn.functional.log_softmax", "torch.special.softmax", "torch.special.log_softmax"}


class _LowpNames(RuleVisitor):
    """Visits in source order, tracking names that hold low-precision tensors: results of calls
    made inside an enabled autocast (except losses, which autocast runs in float32) and results
    of manual casts."""

    def __init__(self, ctx: FileContext) -> None:
        super().__init__(ctx)
        self.lowp: set[str] = set()

    def _update(self, targets: list[ast.AST], value: ast.AST | None, node: ast.AST) -> None:
        if isinstance(value, ast.Call) and float32_result(self.ctx, value):
            lowp = False  # softmax(..., dtype=torch.float32), x.float(): float32 from here on
        elif isinstance(value, ast.Call):
            lowp = self.ctx.lowp_cast_dtype(value) is not None or (
                self.ctx.in_autocast(node) and not _is_loss_call(self.ctx, value)) or (
                (self.ctx.call_name(value) or "").split(".")[-1] in self.ctx.lowp_functions)
        else:  # a matmul or other arithmetic computed under autocast
            lowp = isinstance(value, ast.BinOp) and self.ctx.in_autocast(node)
        for t in targets:
            if isinstance(t, ast.Name):
                (self.lowp.add if lowp else self.lowp.discard)(t.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        self._update(node.targets, node.value, node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self._update([node.target], node.value, node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        saved, self.lowp = self.lowp, set()
        self.generic_visit(node)
        self.lowp = saved

    visit_AsyncFunctionDef = visit_FunctionDef

    def operand(self, call: ast.Call) -> ast.AST | None:
        if isinstance(call.func, ast.Attribute) and not (self.ctx.qualname(call.func) or "").startswith("torch."):
            return call.func.value
        return call.args[0] if call.args else None


@declare_rule(
    "AMP004", "softmax-without-dtype", Severity.MEDIUM, training_path=True,
    explanation=(
        "softmax/log_softmax without dtype= runs in the input's low precision here (CUDA autocast "
        "promotes it, CPU bf16 autocast and manual casts do not); exp() overflows in float16."),
    suggestion="Pass dtype=torch.float32 (e.g. F.softmax(x, dim=-1, dtype=torch.float32)).")
class SoftmaxNoDtype(_LowpNames):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = ctx.call_name(node) or ""
        is_method = isinstance(node.func, ast.Attribute) and node.func.attr in ("softmax", "log_softmax") \
            and not name.startswith("torch.")
        if (name in _SOFTMAX or is_method) and not _has_kw(node, "dtype"):
            scope = ctx.scope_of(node)
            op = node.func.attr if isinstance(node.func, ast.Attribute) else name.split(".")[-1]
            if scope is not None and scope.enabled and scope.device == "cpu":
                self.report(node, f"{op} without dtype under CPU autocast (not promoted to float32)")
            elif scope is None or not scope.enabled:
                x = self.operand(node)
                if (isinstance(x, ast.Name) and x.id in self.lowp) or (
                        not ctx.autocast_scopes and not _accelerate_autocast(ctx) and any(
                            ctx.lowp_cast_dtype(c) == "float16" for c in training_lowp_casts(ctx))):
                    self.report(node, f"{op} without dtype on a low-precision tensor")
        self.generic_visit(node)


@declare_rule(
    "AMP005", "reduction-outside-autocast", Severity.MEDIUM, training_path=True,
    explanation=(
        "sum/mean on a low-precision tensor outside autocast returns float16/bfloat16; large "
        "reductions lose the small terms (big numbers eat small ones)."),
    suggestion="Reduce in float32: x.float().sum() or x.sum(dtype=torch.float32), or keep it inside autocast.")
class ReductionOutsideAutocast(_LowpNames):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = ctx.call_name(node) or ""
        is_method = isinstance(node.func, ast.Attribute) and node.func.attr in ("sum", "mean") \
            and not name.startswith("torch.")
        if (is_method or name in ("torch.sum", "torch.mean")) and not ctx.in_autocast(node) \
                and not _has_kw(node, "dtype"):
            x = self.operand(node)
            if isinstance(x, ast.Name) and x.id in self.lowp:
                op = node.func.attr if isinstance(node.func, ast.Attribute) else name
                self.report(node, f"{op}() on low-precision tensor `{x.id}` outside autocast")
        self.generic_visit(node)


# ---- AMP004: float32 copies made and not used ----------------------------------------------------
def _loads_after(fn: ast.AST, name: str, line: int) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) and n.lineno > line
               for n in ast.walk(fn))


class UnusedUpcastSoftmax(RuleVisitor):
    """``q32 = q.float()`` for the attention scores, then a softmax without dtype on scores made
    from the original tensors: the upcast copies are never read, so the softmax runs in float16."""

    def run(self):
        ctx = self.ctx
        for fn in (n for n in ctx.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            dead = [(t.id, st.lineno) for st in ast.walk(fn) if isinstance(st, ast.Assign)
                    and is_float32_cast(ctx, st.value) for t in st.targets if isinstance(t, ast.Name)
                    and not _loads_after(fn, t.id, st.lineno)]
            if not dead:
                continue
            for c in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                name = ctx.call_name(c) or ""
                is_softmax = name in _SOFTMAX or (isinstance(c.func, ast.Attribute) and c.func.attr in
                                                  ("softmax", "log_softmax") and not name.startswith("torch."))
                copies = [d for d, line in dead if line < c.lineno]
                if is_softmax and copies and not _has_kw(c, "dtype") and not ctx.in_autocast(c):
                    self.report(c, f"softmax without dtype: the float32 copies {', '.join(f'`{d}`' for d in copies)} "
                                   "made above are never used, so the scores stay in the input's precision")
        return self.hits


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (SoftmaxNoDtype.rule, ReductionOutsideAutocast.rule,)
