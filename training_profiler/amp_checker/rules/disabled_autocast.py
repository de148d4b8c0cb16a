"""AMP028: autocast turned off, and the inputs not upcast.

``autocast(enabled=False)`` (a decorator, or a ``with`` block) stops autocast from choosing
dtypes; it does not convert anything. Tensors that arrive from the callers' float16 autocast stay
float16, so the region runs its matmuls in float16 (what it was meant to avoid), or fails where
they meet float32 parameters ("expected both operands to have the same dtype"). torch's own
guidance is to cast the inputs to float32 inside the region. Public fixes: vector-quantize-
pytorch's codebook (2023), efficientvit's multi-scale linear attention (2023).
"""
from __future__ import annotations

import ast
import re

from quant.vocabulary import LOW_PRECISION_DTYPES, Severity
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import is_float32_cast
from training_profiler.amp_checker.precision import (
    in_model_library,
    own_precisions,
)
from training_profiler.amp_checker.rules.base import (
    LIBRARY_NOTE,
    Confidence,
    Rule,
    RuleVisitor,
    declare_rule,
)

_PRODUCTS = ("matmul", "bmm", "mm", "einsum", "cdist", "linear", "conv1d", "conv2d", "conv3d", "baddbmm")
#: parameter names that hold no float activations (a text encoder's texts, token ids, masks)
_NOT_ACTIVATIONS = re.compile(r"text|token|(^|_)ids?$|mask|label|idx|indices|caption|prompt|len|size|device|"
                              r"shape|(^|_)dims?$|num_|count|steps?$", re.I)
_FACTORIES = {"arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "linspace", "logspace", "eye",
              "tensor", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}


def _region(ctx: FileContext, node: ast.AST) -> tuple[ast.AST, list[ast.stmt]] | None:
    """(the function, the statements that run with autocast off) for a decorator or a ``with``
    item that turns it off."""
    parent = ctx.parents.get(node)
    if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in parent.decorator_list:
        return parent, parent.body
    if isinstance(parent, ast.withitem):
        stmt = ctx.parents.get(parent)
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            return ctx.enclosing_function(stmt), stmt.body
    return None


def _handled(ctx: FileContext, fn: ast.AST, name: str, before: int) -> bool:
    """``name`` is cast before line ``before``: a float32 cast of it anywhere earlier, or a
    rebinding to a method of itself (``x = x.to(dtype)``, whatever dtype: its author chose)."""
    for n in ast.walk(fn):
        if getattr(n, "lineno", before) > before:
            continue
        if isinstance(n, ast.Call) and is_float32_cast(ctx, n) and (dotted(_root(n.func)) or "") == name:
            return True
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets) \
                and isinstance(n.value, ast.Call) and (dotted(_root(n.value.func)) or "") == name:
            return True
    return False


def _root(expr: ast.AST) -> ast.AST:
    while isinstance(expr, (ast.Attribute, ast.Call, ast.Subscript)):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr


def _uses(ctx: FileContext, stmts: list[ast.stmt], methods: set[str]):
    """(call, operand) for each product or layer call in ``stmts`` and each bare name among its
    operands: ``torch.matmul(x, w)``, ``x @ w``, ``self.proj(x)`` (a layer: not one of the
    class's own ``methods``)."""
    for st in stmts:
        for n in ast.walk(st):
            operands: list[ast.AST] = []
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
                operands = [n.left, n.right]
            elif isinstance(n, ast.Call):
                callee = ctx.call_name(n) or dotted(n.func) or ""
                layer = callee.startswith("self.") and callee.count(".") == 1 and callee[5:] not in methods
                if callee.rsplit(".", 1)[-1] in _PRODUCTS or layer:
                    operands = list(n.args)
            for op in operands:
                if isinstance(op, ast.Name):
                    yield n, op.id


def _derived(ctx: FileContext, fn: ast.AST, params: set[str]) -> set[str]:
    """``params`` and the names the function binds to a reshaping of one of them with no cast
    on the way (``flatten = rearrange(x, "b n d -> (b n) d")``, ``h = x[:, 0]``)."""
    out = set(params)
    for st in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
        if len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) and st.targets[0].id not in params \
                and any(isinstance(n, ast.Name) and n.id in out for n in ast.walk(st.value)) \
                and not any(isinstance(n, ast.Call) and (is_float32_cast(ctx, n) or ctx.lowp_cast_dtype(n)
                                                         or _casts(n)) for n in ast.walk(st.value)):
            out.add(st.targets[0].id)
    return out


def _casts(call: ast.Call) -> bool:
    """A cast, or a new tensor (a factory, anything given ``dtype=``): not the input any more."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id if isinstance(call.func, ast.Name) else ""
    return name in ("to", "type", "type_as", "float", "double") or name in _FACTORIES \
        or any(k.arg == "dtype" for k in call.keywords)


@declare_rule(
    "AMP028", "autocast-off-without-upcast", Severity.MEDIUM,
    explanation=("autocast(enabled=False) stops autocast from choosing dtypes but converts nothing: inputs that "
                 "arrive in float16 from the callers' autocast stay float16, so the region computes in float16 "
                 "(what it was meant to avoid) or fails against float32 parameters."),
    suggestion="Cast the inputs to float32 inside the region (`x = x.float()`), and the result back if needed.")
class AutocastOffWithoutUpcast(RuleVisitor):
    """A parameter of the function used by a product or a layer call inside an
    ``autocast(enabled=False)`` region, with no cast of it before; reported where autocast is
    turned off, where the upcast belongs."""

    def run(self):
        ctx = self.ctx
        for scope in ctx.autocast_scopes:
            if scope.enabled or scope.inherited:
                continue
            found = _region(ctx, scope.node)
            if found is None or not isinstance(found[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            fn, stmts = found
            params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)
                      if not _NOT_ACTIVATIONS.search(a.arg)} - {"self", "cls"}
            cls = ctx.values.enclosing_class(fn)
            methods = {n.name for n in (cls.body if cls is not None else [])
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            inputs = _derived(ctx, fn, params)
            for use, name in _uses(ctx, stmts, methods):
                if name in inputs and not _handled(ctx, fn, name, use.lineno):
                    confidence, why = self._confidence()
                    what = f"`{name}`" if name in params else f"`{name}` (made from an input, not upcast)"
                    self.report(scope.node, f"autocast is turned off here, but {what} is used as it comes (line "
                                            f"{use.lineno}): under the callers' float16 autocast it is still "
                                            f"float16{why}", confidence)
                    break
        return self.hits

    def _confidence(self) -> tuple[Confidence, str]:
        ctx = self.ctx
        if any(own_precisions(m) & set(LOW_PRECISION_DTYPES) for m in ctx.project.users_of(ctx)):
            return Confidence.HIGH, ""
        if in_model_library(ctx):
            return Confidence.MEDIUM, LIBRARY_NOTE.format(why="under their autocast the inputs arrive in half")
        return Confidence.LOW, " (no low-precision training seen; if callers run under autocast)"


RULES: tuple[Rule, ...] = (AutocastOffWithoutUpcast.rule,)
