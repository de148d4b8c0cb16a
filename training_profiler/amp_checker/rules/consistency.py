"""AMP023, AMP024: code whose own dtype handling contradicts itself.

Whether a model runs in float16 is often its users' choice, out of the scan's sight; but code
that matches one tensor's dtype to another's and then recasts the other (xformers' block-sparse
attention: the mask follows ``q.dtype``, then ``q`` becomes float16), or that upcasts an
operation in one method and not in its twin (mamba2: ``exp(A_log.float())`` in ``step``,
``exp(A_log)`` in ``forward``), says itself that the dtypes matter there. Both are reported at
high confidence whatever the scan shows of training: the evidence is the code's own.
"""
from __future__ import annotations

import ast

from quant.vocabulary import LOW_PRECISION_DTYPES, Severity
from training_profiler.amp_checker.context import FileContext
from training_profiler.amp_checker.intent import is_float32_cast
from training_profiler.amp_checker.rules.base import Rule, RuleVisitor, declare_rule


def _matched_to(call: ast.AST) -> str | None:
    """``x.to(q.dtype)`` / ``x.to(dtype=q.dtype)`` / ``x.type_as(q)``: the name ``q`` whose
    dtype ``x`` is made to follow."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return None
    args = [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")]
    if call.func.attr == "type_as" and len(call.args) == 1 and isinstance(call.args[0], ast.Name):
        return call.args[0].id
    if call.func.attr == "to":
        for a in args:
            if isinstance(a, ast.Attribute) and a.attr == "dtype" and isinstance(a.value, ast.Name):
                return a.value.id
    return None


def _fixed_recast(ctx: FileContext, value: ast.AST, name: str) -> str | None:
    """``name.half()`` / ``name.to(torch.float16)`` / ``name.float()``: the fixed dtype ``name``
    is recast to."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and isinstance(value.func.value, ast.Name) and value.func.value.id == name):
        return None
    return ctx.lowp_cast_dtype(value) or ("float32" if is_float32_cast(ctx, value) else None)


def _pairs(target: ast.AST, value: ast.AST) -> list[tuple[str, ast.AST]]:
    """(name, value) of an assignment, tuples unpacked element by element."""
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return [(t.id, v) for t, v in zip(target.elts, value.elts) if isinstance(t, ast.Name)]
    return []


def _assignments(fn: ast.AST) -> list[tuple[ast.Assign, str, ast.AST]]:
    out = []
    for st in ast.walk(fn):
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            out += [(st, name, value) for name, value in _pairs(st.targets[0], st.value)]
    return sorted(out, key=lambda x: (x[0].lineno, x[0].col_offset))


def _loads_after(fn: ast.AST, name: str, line: int) -> list[ast.Name]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name
            and isinstance(n.ctx, ast.Load) and n.lineno > line]


@declare_rule(
    "AMP023", "dtype-match-undone", Severity.HIGH,
    explanation=("A tensor is cast to follow another's dtype (`mask = mask.to(q.dtype)`), then the other is "
                 "recast to a fixed dtype (`q = q.half()`) while the first is still used: the two meet in "
                 "different dtypes again, which the match was written to prevent (a dtype error in a kernel, "
                 "or a silent promotion)."),
    suggestion="Match after the recast (`mask = mask.to(q.dtype)` below `q = q.half()`), or recast both.")
class DtypeMatchUndone(RuleVisitor):
    """``att_mask = att_mask.to(q.dtype)`` then ``q, k, v = q.half(), k.half(), v.half()`` and
    ``att_mask`` used below (xformers' block-sparse attention, fixed by casting the mask too)."""

    def run(self):
        if any(_matched_to(c) for c in self.ctx.calls):  # nothing matched to another dtype: nothing to undo
            self.visit(self.ctx.tree)
        return self.hits

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        assigns = _assignments(node)
        for st, name, value in assigns:
            anchor = _matched_to(value)
            if anchor is None or anchor == name:
                continue
            for later, recast_name, recast in assigns:
                if later.lineno <= st.lineno or recast_name != anchor:
                    continue
                dtype = _fixed_recast(self.ctx, recast, anchor)
                rematched = any(s.lineno > later.lineno and n == name for s, n, _ in assigns)
                if dtype and not rematched and _loads_after(node, name, later.lineno):
                    self.report(later, f"`{anchor}` is recast to {dtype} after `{name}` was matched to its "
                                       f"dtype (line {st.lineno}); `{name}` is used below in the old dtype")
                break  # the first rebinding of the anchor decides
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef


_SENSITIVE = {"exp", "log", "log1p", "expm1", "softplus", "softmax", "log_softmax", "logsumexp",
              "pow", "sqrt", "rsqrt", "cumsum", "cumprod", "sigmoid"}


def _op_and_operand(ctx: FileContext, call: ast.Call) -> tuple[str, ast.AST] | None:
    """``torch.exp(x)`` / ``F.softplus(x)`` / ``x.exp()``: ("exp", x)."""
    if isinstance(call.func, ast.Attribute) and call.func.attr in _SENSITIVE:
        q = ctx.call_name(call) or ""
        if q.startswith(("torch.", "F.")) or q.split(".", 1)[0] in ctx.aliases:
            return (call.func.attr, call.args[0]) if call.args else None
        return call.func.attr, call.func.value
    return None


def _upcast_operand(ctx: FileContext, expr: ast.AST) -> ast.AST | None:
    """``y.float()`` / ``y.to(torch.float32)``: ``y``."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and is_float32_cast(ctx, expr):
        return expr.func.value
    return None


@declare_rule(
    "AMP024", "upcast-skipped-here", Severity.MEDIUM,
    explanation=("The same numerically sensitive operation (exp, log, softplus, softmax, a power or root, a "
                 "cumulative sum) is computed on the same value in float32 in one place and in the value's "
                 "own dtype in another: the code's authors upcast it for a reason, and in a float16/bfloat16 "
                 "model the copy without the upcast overflows or rounds (mamba2's exp(A_log))."),
    suggestion="Upcast here as well (`torch.exp(x.float())`), casting the result back if needed.")
class UpcastSkippedHere(RuleVisitor):
    """``torch.exp(self.A_log)`` in one method of a class and ``torch.exp(self.A_log.float())``
    in another (or in the same module for free functions)."""

    def run(self):
        ctx = self.ctx
        upcast: dict[tuple[ast.AST | None, str, str], ast.Call] = {}
        plain: list[tuple[ast.AST | None, str, str, ast.Call]] = []
        for c in ctx.calls:
            found = _op_and_operand(ctx, c)
            if found is None:
                continue
            op, operand = found
            owner = ctx.values.enclosing_class(c)
            inner = _upcast_operand(ctx, operand)
            if inner is not None:
                upcast.setdefault((owner, op, ast.unparse(inner)), c)
            elif ctx.dtype_of(operand) in (None, "unknown", *LOW_PRECISION_DTYPES):
                plain.append((owner, op, ast.unparse(operand), c))
        for owner, op, text, c in plain:
            twin = upcast.get((owner, op, text))
            if twin is not None and ctx.enclosing_function(twin) is not ctx.enclosing_function(c):
                self.report(c, f"{op}() of `{text}` in its own dtype; line {twin.lineno} computes it from "
                               f"`{text}` upcast to float32")
        return self.hits


def _upcast_inputs(ctx: FileContext, fn: ast.AST) -> dict[str, ast.Assign]:
    """Parameters of ``fn`` rebound to a float32 cast of themselves (``x = x.float()``)."""
    params = {a.arg for a in fn.args.args}
    out: dict[str, ast.Assign] = {}
    for st in ast.walk(fn):
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) \
                and st.targets[0].id in params and is_float32_cast(ctx, st.value) \
                and isinstance(st.value.func.value, ast.Name) and st.value.func.value.id == st.targets[0].id:
            out.setdefault(st.targets[0].id, st)
    return out


def _layer_calls_on(fn: ast.AST, name: str, after: int = 0) -> list[ast.Call]:
    """Calls of the module's own layers (``self.lora_A[a](...)``) whose arguments hold ``name``,
    below line ``after``, outermost first."""
    out = []
    for c in ast.walk(fn):
        if isinstance(c, ast.Call) and c.lineno > after and (ast.unparse(c.func).startswith("self.")) \
                and not (isinstance(c.func, ast.Attribute) and c.func.attr in ("to", "float", "half", "type")) \
                and any(isinstance(n, ast.Name) and n.id == name for a in c.args for n in ast.walk(a)):
            out.append(c)
    return out


class LayersOnUpcastInputElsewhere(RuleVisitor):
    """AMP024 for layers: ``self.lora_B(self.lora_A(x))`` on ``x`` as it comes in one forward,
    while another forward of the module applies the same layers to ``x`` after ``x = x.float()``
    (peft's LoRA Linear beside its 8-bit variant): the authors know the layers are float32 and
    the input may not be."""

    def run(self):
        ctx = self.ctx
        fns = [n for n in ctx.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        upcast: dict[tuple[str, str], tuple[ast.Call, ast.Assign]] = {}
        for fn in fns:
            for name, st in _upcast_inputs(ctx, fn).items():
                for c in _layer_calls_on(fn, name, st.lineno):
                    upcast.setdefault((name, ast.unparse(c)), (c, st))
        if not upcast:
            return self.hits
        for fn in fns:
            done: set[int] = set()
            for name in {a.arg for a in fn.args.args} - set(_upcast_inputs(ctx, fn)):
                for c in _layer_calls_on(fn, name):
                    twin = upcast.get((name, ast.unparse(c)))
                    if twin is None or id(c) in done or ctx.enclosing_function(twin[0]) is fn:
                        continue
                    done |= {id(n) for n in ast.walk(c)}
                    self.report(c, f"`{ast.unparse(c.func)}` takes `{name}` in its own dtype; line "
                                   f"{twin[0].lineno} applies the same layers to `{name}` upcast to float32 "
                                   f"(line {twin[1].lineno})")
        return self.hits


RULES: tuple[Rule, ...] = (DtypeMatchUndone.rule, UpcastSkippedHere.rule)
