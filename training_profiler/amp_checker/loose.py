"""The original checker's rules where this checker sees no mixed-precision training.

A user who runs the checker on one model file cares about that file even when nothing in it
trains: an attention helper doing ``q.half() @ k.half().transpose(-2, -1)`` and a softmax without
``dtype`` on the result is a HIGH and a MEDIUM hazard whoever calls it. These visitors report
each documented pattern the AMP-aware rules left alone, at the confidence the evidence allows:

- HIGH: the value is low precision by a cast the code itself makes (a softmax or a sum of
  ``q.half() @ k``), whatever trains it;
- MEDIUM: an autograd Function is called under autocast but does nothing dtype-sensitive;
- LOW: no training is seen; the message says so ("no training seen; if this runs under AMP…").
"""
from __future__ import annotations

import ast

from quant.vocabulary import LOW_PRECISION_DTYPES
from training_profiler.amp_checker.context import FileContext
from training_profiler.amp_checker.intent import (
    TRAINING,
    _times_itself,
    cast_purpose,
    float32_result,
    on_non_amp_branch,
    per_project,
    profiling_region,
    trains,
)
from training_profiler.amp_checker.precision import own_precisions
from training_profiler.amp_checker.rules.autocast_scope import _BCE
from training_profiler.amp_checker.rules.autograd_function import _is_autograd_function
from training_profiler.amp_checker.rules.base import NO_TRAINING_NOTE, Confidence, RuleVisitor
from training_profiler.amp_checker.rules.helpers import _has_kw
from training_profiler.amp_checker.rules.reductions import _SOFTMAX


def _note(seen: str, why: str) -> str:
    return NO_TRAINING_NOTE.format(why=why).replace("no training seen", seen)


def _amp_seen(ctx: FileContext) -> bool:
    return ctx.uses_amp or ctx.library_amp


def _users_use_amp(ctx: FileContext) -> bool:
    key = "_fact_users_use_amp"
    if key not in ctx.facts:
        ctx.facts[key] = any(m.uses_amp or m.library_amp for m in ctx.project.users_of(ctx) if m is not ctx)
    return ctx.facts[key]


# ---- low-precision values made by casts -----------------------------------------------------
def cast_dtype_of(ctx: FileContext, expr: ast.AST, names: dict[str, str]) -> str | None:
    """'float16'/'bfloat16' when ``expr`` is low precision because of a cast the code makes:
    the cast itself, a name bound to one, arithmetic, a matmul, a method (transpose, view,
    masked_fill) or a torch function applied to one. A float32 result (``.float()``,
    ``dtype=torch.float32``) ends it: the answer is then 'float32', and a name bound to one
    keeps saying so (the code upcast on purpose)."""
    if float32_result(ctx, expr):
        return "float32"
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if isinstance(expr, ast.BinOp):
        return _promoted([cast_dtype_of(ctx, expr.left, names), cast_dtype_of(ctx, expr.right, names)])
    if isinstance(expr, ast.Subscript):
        return cast_dtype_of(ctx, expr.value, names)
    if isinstance(expr, ast.Attribute) and expr.attr in ("T", "mT"):
        return cast_dtype_of(ctx, expr.value, names)
    if not isinstance(expr, ast.Call):
        return None
    if (d := ctx.lowp_cast_dtype(expr)) is not None:
        return d if _literal_dtype(ctx, expr) else None  # `.to(weight_dtype)`: chosen at run time
    if isinstance(expr.func, ast.Attribute) and not (ctx.qualname(expr.func) or "").startswith("torch."):
        return cast_dtype_of(ctx, expr.func.value, names)
    if (ctx.call_name(expr) or "").startswith("torch."):
        return _promoted([cast_dtype_of(ctx, a, names) for a in expr.args])
    return None


def _literal_dtype(ctx: FileContext, cast: ast.Call) -> bool:
    """``.half()``, ``.to(torch.float16)``: the dtype is written in the code, not a variable
    that one configuration sets to float16 and another to float32."""
    args = [*cast.args, *(k.value for k in cast.keywords if k.arg == "dtype")]
    return all((ctx.qualname(a) or "").startswith("torch.") or isinstance(a, ast.Constant) for a in args)


def _promoted(dtypes: list[str | None]) -> str | None:
    """Type promotion of the known operand dtypes: float32 wins over a low precision."""
    known = [d for d in dtypes if d]
    return "float32" if "float32" in known else (known[0] if known else None)


def cast_names_before(ctx: FileContext, node: ast.AST) -> dict[str, str]:
    """Names of ``node``'s function holding low-precision values made by casts, from the
    assignments above ``node`` in source order (branches are not told apart)."""
    fn = ctx.enclosing_function(node)
    key = "_fact_cast_assigns"
    table = ctx.facts.setdefault(key, {})
    if fn not in table:
        assigns = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign)
                          and ctx.enclosing_function(n) is fn), key=lambda n: (n.lineno, n.col_offset))
        table[fn] = assigns
    names: dict[str, str] = {}
    for a in table[fn]:
        if a.lineno >= node.lineno:
            break
        d = cast_dtype_of(ctx, a.value, names)
        for t in a.targets:
            if isinstance(t, ast.Name):
                if d:
                    names[t.id] = d
                else:
                    names.pop(t.id, None)
    return names


def _operand(ctx: FileContext, call: ast.Call) -> ast.AST | None:
    if isinstance(call.func, ast.Attribute) and not (ctx.qualname(call.func) or "").startswith("torch."):
        return call.func.value
    return call.args[0] if call.args else None


def _in_enabled_autocast(ctx: FileContext, node: ast.AST) -> bool:
    scope = ctx.scope_of(node)
    return scope is not None and scope.enabled


# ---- the documented rows ------------------------------------------------------------------------
class LooseManualCast(RuleVisitor):
    """AMP001 where no AMP training is seen in the module: a training-purpose cast (not a
    checkpoint copy, an evaluation model, a round trip or a frozen module)."""

    def run(self):
        ctx = self.ctx
        if not ctx.manual_lowp_casts or trains(ctx):
            return self.hits  # AMP001 (under AMP) or AMP008 (pure float16) judged every cast here
        for c in ctx.manual_lowp_casts:
            if cast_purpose(ctx, c) != TRAINING or on_non_amp_branch(ctx, c) or _benchmarking(ctx, c):
                continue
            users = _users_use_amp(ctx)
            attr = c.func.attr
            what = f".{attr}()" if attr in ("half", "bfloat16") else f".{attr}({ctx.lowp_cast_dtype(c)})"
            if users:  # mostly inference paths of a trained package (data, export, predict): low
                self.report(c, f"{what} call detected (no training seen here; a module that imports this one "
                               "trains with AMP, and the cast bypasses autocast if it runs there)", Confidence.LOW)
            else:
                self.report(c, f"{what} call detected" + _note("no training seen",
                                                                "the cast bypasses autocast's float32 ops"),
                            Confidence.LOW)
        return self.hits


def _benchmarking(ctx: FileContext, node: ast.AST) -> bool:
    """Under a profiler, or in a function that reads clocks to time itself (an op profiler
    casting a module to its input's dtype is not training code)."""
    fn = ctx.enclosing_function(node)
    return profiling_region(ctx, node) or (fn is not ctx.tree and _times_itself(ctx, fn))


class LooseBce(RuleVisitor):
    """AMP002 where no AMP is seen: autocast on CUDA refuses binary_cross_entropy outright."""

    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        if ctx.call_name(node) in _BCE and not (_amp_seen(ctx) or ctx.project_uses_amp):
            name = ctx.call_name(node).split(".")[-1]
            self.report(node, f"{name} usage" + _note("no autocast seen", "CUDA autocast raises on it"),
                        Confidence.LOW)
        self.generic_visit(node)


class LooseSoftmax(RuleVisitor):
    """AMP004 on a value the code itself casts to low precision (HIGH: it is float16 whoever
    calls it; MEDIUM for bfloat16, which does not overflow but keeps 8 bits), and on any
    softmax of a module where nothing about precision is seen (LOW)."""

    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = ctx.call_name(node) or ""
        is_method = isinstance(node.func, ast.Attribute) and node.func.attr in ("softmax", "log_softmax") \
            and not name.startswith("torch.")
        if (name in _SOFTMAX or is_method) and not _has_kw(node, "dtype") and not _in_enabled_autocast(ctx, node):
            op = node.func.attr if isinstance(node.func, ast.Attribute) else name.split(".")[-1]
            x = _operand(ctx, node)
            d = cast_dtype_of(ctx, x, cast_names_before(ctx, node)) if x is not None else None
            if d in LOW_PRECISION_DTYPES:
                self.report(node, f"{op} without dtype on a {d} value (`{ast.unparse(x)[:40]}` comes from a cast)",
                            Confidence.HIGH if d == "float16" else Confidence.MEDIUM)
            elif d is None and not (ctx.uses_lowp or ctx.project_uses_amp or ctx.autocast_scopes
                                    or own_precisions(ctx)):
                self.report(node, f"{op} without dtype" + _note(
                    "no low precision seen", "float16 inputs outside autocast overflow exp()"), Confidence.LOW)
        self.generic_visit(node)


class LooseReduction(RuleVisitor):
    """AMP005 on a value the code itself casts to low precision, through arithmetic and
    matmuls (``(q.half() @ k.half().T).sum()``), outside autocast."""

    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = ctx.call_name(node) or ""
        is_method = isinstance(node.func, ast.Attribute) and node.func.attr in ("sum", "mean") \
            and not name.startswith("torch.")
        if (is_method or name in ("torch.sum", "torch.mean")) and not _has_kw(node, "dtype") \
                and not ctx.in_autocast(node):
            x = _operand(ctx, node)
            d = cast_dtype_of(ctx, x, cast_names_before(ctx, node)) if x is not None else None
            if d in LOW_PRECISION_DTYPES:
                op = node.func.attr if isinstance(node.func, ast.Attribute) else name
                self.report(node, f"{op}() on {d} value `{ast.unparse(x)[:40]}` (from a cast) outside autocast",
                            Confidence.HIGH if d == "float16" else Confidence.MEDIUM)
        self.generic_visit(node)


def _applied_under_autocast(ctx: FileContext, cls: ast.ClassDef) -> tuple[FileContext, ast.Call] | None:
    """A ``Cls.apply(...)`` call (or of a name bound to ``Cls.apply``) under an enabled autocast,
    in this module or any module of its program (indexed once per program, by class name)."""
    return _apply_index(ctx).get(cls.name)


@per_project
def _apply_index(ctx: FileContext) -> dict[str, tuple[FileContext, ast.Call] | None]:
    """Class name -> its first ``.apply`` call under an enabled autocast in the program (None
    when applied only outside autocast), built once per program."""
    index: dict[str, tuple[FileContext, ast.Call] | None] = {}
    for m in ctx.project.program_modules(ctx):
        aliases = {t.id: st.value.value.id for st in ast.walk(m.tree) if isinstance(st, ast.Assign)
                   and isinstance(st.value, ast.Attribute) and st.value.attr == "apply"
                   and isinstance(st.value.value, ast.Name) for t in st.targets if isinstance(t, ast.Name)}
        for c in m.calls:
            f = c.func
            name = f.value.id if (isinstance(f, ast.Attribute) and f.attr == "apply" and isinstance(f.value, ast.Name)) \
                else aliases.get(f.id) if isinstance(f, ast.Name) else None
            if name and index.get(name) is None:
                index[name] = (m, c) if _in_enabled_autocast(m, c) else None
    return index


def _applied(ctx: FileContext, cls: ast.ClassDef) -> bool:
    """``Cls.apply`` is called somewhere in the scan (under autocast or not)."""
    return cls.name in _apply_index(ctx)


class LooseAutogradFunction(RuleVisitor):
    """AMP006 for every custom autograd Function without custom_fwd/custom_bwd that the
    AMP-aware rule passed over (nothing in it mixes dtypes that the checker can see): MEDIUM when
    it is applied under autocast somewhere in the scan; LOW when it is only applied in a module
    (or project) that trains under AMP (communication and reshaping Functions: 0 of 6 such
    findings were hazards on the corpus), or when no AMP reaches it; nothing for an unused one
    beside AMP code."""

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        ctx = self.ctx
        if _is_autograd_function(ctx, node):
            under = _applied_under_autocast(ctx, node)
            amp_near = (_amp_seen(ctx) or ctx.project_uses_amp) and _applied(ctx, node)
            for item in node.body:
                if not (isinstance(item, ast.FunctionDef) and item.name in ("forward", "backward")):
                    continue
                want = "custom_fwd" if item.name == "forward" else "custom_bwd"
                decs = [(ctx.qualname(d.func if isinstance(d, ast.Call) else d) or "") for d in item.decorator_list]
                if any(d.split(".")[-1] == want for d in decs):
                    continue
                what = f"autograd.Function {node.name}.{item.name} without @{want}"
                if under is not None:
                    m, call = under
                    self.report(item, f"{what} (applied under autocast at {m.path.rsplit('/', 1)[-1]}:{call.lineno})",
                                Confidence.MEDIUM)
                elif amp_near:  # applied by a model that this code trains under autocast
                    self.report(item, f"{what} (applied in code that trains under autocast; nothing "
                                      "dtype-sensitive is seen in it)", Confidence.LOW)
                elif not (_amp_seen(ctx) or ctx.project_uses_amp):
                    self.report(item, what + _note("no autocast seen", "its inputs may arrive in mixed dtypes"),
                                Confidence.LOW)
        self.generic_visit(node)
