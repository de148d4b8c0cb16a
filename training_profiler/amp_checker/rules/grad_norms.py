"""AMP029: a total gradient norm taken in the gradients' own dtype.

A hand-written ``clip_grad_norm`` (``torch.norm(torch.stack([torch.norm(p.grad, 2) for p in
params]), 2)``, or ``total += p.grad.norm() ** 2``) returns each norm in the gradient's dtype.
With float16 gradients (pure-fp16 parameters, an fp16 optimizer, fp16 gradient reduction) a
norm above 65504, or its square, is inf, and clipping by inf zeroes the step or makes it NaN
(fairscale's OSS and ``calc_grad_norm`` until 2021). Native AMP keeps float32 parameters and
so float32 gradients: the same code is harmless there, so the rule wants to see float16
gradients in the project before it is sure.
"""
from __future__ import annotations

import ast

from quant.vocabulary import FLOAT16, Severity
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import per_project
from training_profiler.amp_checker.rules.base import Confidence, Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import in_parameter, names_in, upcast_in

_NORM_FUNCTIONS = ("torch.norm", "torch.linalg.norm", "torch.linalg.vector_norm")
_COMBINERS = ("stack", "cat", "sum")  # a list of norms made into one number
_PARAM_WORDS = ("param", "grad", "weight")


def _norm_operand(ctx: FileContext, call: ast.Call) -> ast.AST | None:
    """What ``call`` takes the norm of, when it is a norm without ``dtype=``."""
    if any(k.arg == "dtype" for k in call.keywords):
        return None
    if (ctx.qualname(call.func) or "") in _NORM_FUNCTIONS:
        given = [*call.args[:1], *(k.value for k in call.keywords if k.arg in ("input", "x", "A"))]
        return given[0] if given else None
    if isinstance(call.func, ast.Attribute) and call.func.attr == "norm":
        return call.func.value
    return None


def _grad_source(ctx: FileContext, expr: ast.AST, fn: ast.AST) -> ast.AST | None:
    """The expression naming ``.grad`` that ``expr`` is (directly, or through one local name
    assigned from it), unless it is upcast on the way; None when it is not a gradient."""
    if upcast_in(ctx, expr) or any(isinstance(n, ast.Call) and _norm_operand(ctx, n) is not None
                                 for n in ast.walk(expr)):
        return None  # upcast, or a norm of norms (the inner norms are the finding)
    if any(isinstance(n, ast.Attribute) and n.attr == "grad" for n in ast.walk(expr)):
        return expr
    if isinstance(expr, ast.Name):
        for st in ast.walk(fn):
            if isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == expr.id for t in st.targets):
                if any(isinstance(n, ast.Attribute) and n.attr == "grad" for n in ast.walk(st.value)):
                    return None if upcast_in(ctx, st.value) else st.value
    return None


def _combined(ctx: FileContext, call: ast.Call, fn: ast.AST) -> bool:
    """The norm goes into a total: stacked or summed with others, raised to a power, or added
    up (directly, or through the name it is assigned to)."""
    stmt = call
    for parent in ctx.parents_chain(call):
        if isinstance(parent, ast.Call) and (ctx.call_name(parent) or dotted(parent.func) or "").rsplit(".", 1)[-1] \
                in _COMBINERS:
            return True
        if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Pow):
            return True
        if isinstance(parent, ast.AugAssign):
            return True
        if isinstance(parent, ast.stmt):
            stmt = parent
            break
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return False
    name = stmt.targets[0].id
    for n in ast.walk(fn):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow) and name in names_in(n.left):
            return True
        if isinstance(n, ast.AugAssign) and name in names_in(n.value):
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "append" \
                and any(name in names_in(a) for a in n.args):
            return True
    return False


@per_project
def _float16_gradients(ctx: FileContext) -> str | None:
    """Where the project shows float16 parameters or gradients: a gradient or parameter data
    cast to float16, a parameter made with a float16 dtype, or a parameter's dtype compared
    with float16."""
    return next((w for m in ctx.project.program_modules(ctx) if (w := _float16_here(m))), None)


def _float16_here(m: FileContext) -> str | None:
    where = m.path.rsplit("/", 1)[-1]
    for n in m.nodes:
        if isinstance(n, ast.Call) and m.lowp_cast_dtype(n) == "float16":
            receiver = n.func.value
            if any(isinstance(a, ast.Attribute) and a.attr in ("grad", "data") for a in ast.walk(receiver)):
                return f"{ast.unparse(receiver)[:40]} cast to float16 at {where}:{n.lineno}"
        elif isinstance(n, ast.keyword) and n.arg == "dtype" and m.literal_dtype(n.value) == FLOAT16 \
                and in_parameter(m, n):
            return f"a float16 Parameter at {where}:{n.value.lineno}"
        elif isinstance(n, ast.Compare) and any(m.literal_dtype(e) == FLOAT16 for e in [n.left, *n.comparators]):
            sides = [e for e in [n.left, *n.comparators] if isinstance(e, ast.Attribute) and e.attr == "dtype"]
            if any(w in ast.unparse(s.value).lower() or ast.unparse(s.value) == "p" for s in sides for w in _PARAM_WORDS):
                return f"a parameter dtype checked for float16 at {where}:{n.lineno}"
    return None


@declare_rule(
    "AMP029", "grad-norm-in-low-precision", Severity.MEDIUM, training_path=True,
    explanation=("A gradient norm taken in the gradients' own dtype: with float16 gradients a norm above 65504 "
                 "(or its square, summed into a total) is inf, and clipping by an inf total norm zeroes the "
                 "step or makes it NaN."),
    suggestion=("Take each norm in float32: torch.linalg.vector_norm(g, ord, dtype=torch.float32) or "
                "g.float().norm(); or use torch.nn.utils.clip_grad_norm_."))
class GradNormInLowPrecision(RuleVisitor):
    """A norm of ``.grad`` (directly or through one local name) with no ``dtype=`` and no
    upcast, that goes into a total norm (stacked, summed, powered, accumulated). HIGH where
    the project shows float16 gradients or parameters; LOW elsewhere (native AMP keeps
    float32 gradients, so the code is only a hazard where parameters are float16)."""

    def run(self):
        ctx = self.ctx
        if not any(isinstance(n, ast.Attribute) and n.attr == "grad" for n in ctx.nodes):
            return self.hits
        for call in ctx.calls:
            operand = _norm_operand(ctx, call)
            if operand is None:
                continue
            fn = ctx.enclosing_function(call)
            source = _grad_source(ctx, operand, fn)
            if source is None or not _combined(ctx, call, fn):
                continue
            evidence = _float16_gradients(ctx)
            what = f"gradient norm of {ast.unparse(source)[:40]} in the gradients' dtype, summed into a total norm"
            if evidence:
                self.report(call, f"{what}: float16 gradients ({evidence}) make a norm above 65504 inf", Confidence.HIGH)
            else:
                self.report(call, f"{what} (no float16 gradients seen in the project; a hazard only where parameters "
                                  "or gradients are float16)", Confidence.LOW)
        return self.hits


RULES: tuple[Rule, ...] = (GradNormInLowPrecision.rule,)
