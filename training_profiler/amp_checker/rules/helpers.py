"""Questions several rule families ask: is this call a loss, which number is this, does this
branch pick bfloat16, does this module train in float16, did Accelerate set up autocast."""
from __future__ import annotations

import ast
import re

import numpy as np

from quant.vocabulary import BFLOAT16, FLOAT16
from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import is_float32_cast, per_module, training_lowp_casts
from training_profiler.amp_checker.precision import (
    in_model_library,
    own_precisions,
    trains_in,
)
from training_profiler.amp_checker.rules.base import LIBRARY_NOTE, NO_TRAINING_NOTE, Confidence

_FP16 = np.finfo(np.float16)
FP16_MAX = float(_FP16.max)
FP16_MIN_SUBNORMAL = float(_FP16.smallest_subnormal)
FP16_MIN_NORMAL = float(_FP16.smallest_normal)
#: the largest n up to which every integer is exact: 2 ** (stored mantissa bits + 1), i.e. 2 / eps
#: (bfloat16 stores 7 mantissa bits; numpy has no bfloat16 to ask)
EXACT_INTEGERS = {FLOAT16: int(2 / _FP16.eps), BFLOAT16: 2 ** (7 + 1)}


_LOSS_NAME = re.compile(r"(loss|crit|cross_entropy|nll|mse|bce|kl_div|huber)", re.I)
_NOT_A_LOSS = {av.SCALER, av.SCALER_FACTORY, av.OPTIMIZER, av.AUTOCAST, av.AUTOCAST_FACTORY,
               av.CLASS, av.FUNCTION, av.NULL_CONTEXT}


def _is_loss_call(ctx: FileContext, call: ast.Call) -> bool:
    """A call that computes a loss: a torch loss function, an ``nn.*Loss`` module (however it
    reached this name), or a project function that returns one. Only a callee nothing is known
    of (a parameter, a library object) falls back to its name, and then not when it is given
    an optimizer or a GradScaler (``loss_scaler(loss, optimizer)`` applies a loss, it does not
    compute one)."""
    if any(v.kind == av.LOSS for v in ctx.values.value(call)):
        return True
    if ctx.values.kinds(call.func) & _NOT_A_LOSS:
        return False
    name = (ctx.call_name(call) or "").split(".")[-1]
    if not _LOSS_NAME.search(name) or "scal" in name.lower():
        return False
    args = [*call.args, *(k.value for k in call.keywords)]
    return not any(ctx.values.kinds(a) & {av.OPTIMIZER, av.SCALER} for a in args)


def cast_inputs_dtype(ctx: FileContext, fn: ast.AST) -> str | None:
    """The dtype of ``@custom_fwd(cast_inputs=...)`` on ``fn`` ('unknown' when not a literal
    dtype), None without one: with it, autocast casts every input on the way in and runs the
    body with autocast off."""
    for d in getattr(fn, "decorator_list", []):
        if isinstance(d, ast.Call):
            for k in d.keywords:
                if k.arg == "cast_inputs":
                    return ctx.dtype_of(k.value) or "unknown"
    return None


def _has_kw(call: ast.Call, name: str) -> bool:
    return any(k.arg == name for k in call.keywords)


def _mixed_precision_accelerator(ctx: FileContext, call: ast.AST) -> bool:
    """``accelerate.Accelerator(mixed_precision=...)`` with a value other than the literal "no"
    (``mixed_precision=args.mixed_precision`` is a run-time choice: it may be fp16)."""
    q = (ctx.call_name(call) or "") if isinstance(call, ast.Call) else ""
    if not (q.startswith("accelerate") and q.endswith("Accelerator")):
        return False
    mp = next((k.value for k in call.keywords if k.arg == "mixed_precision"), None)
    return mp is not None and not (isinstance(mp, ast.Constant) and mp.value in ("no", None))


def _accelerate_autocast(ctx: FileContext) -> bool:
    """An Accelerator in mixed precision is built here: the models it prepares run under its
    autocast."""
    return any(_mixed_precision_accelerator(ctx, c) for c in ctx.calls)


def _is_accelerator(ctx: FileContext, expr: ast.AST) -> bool:
    """``expr`` names an Accelerator built here in mixed precision."""
    hit = ctx.values.bindings_at(expr).lookup(expr.id) if isinstance(expr, ast.Name) else None
    return any(how == "assign" and _mixed_precision_accelerator(ctx, value) for how, value in (hit[1] if hit else []))


_BF16_WORDS = ("bf16", "bfloat16")
#: names of boolean switches that say bfloat16 was asked for (``cfg.bf16``, ``args.use_bf16``)
_BF16_FLAGS = frozenset({"bf16", "bfloat16", "use_bf16", "is_bf16", "bf16_enabled", "enable_bf16"})


def _selects_bf16(ctx: FileContext, test: ast.AST) -> bool:
    """An ``if`` test that holds when bfloat16 was chosen (``mode == "bf16"``, ``dtype is
    torch.bfloat16``, ``dtype in (torch.float16, torch.bfloat16)``, a switch ``cfg.bf16``; one
    operand of an ``or`` is enough), judged per comparison: the
    one naming bfloat16 must not be negated (``!=``, ``not in``, ``not ...``)."""
    def names_bf16(n: ast.AST) -> bool:
        return any((isinstance(x, ast.Constant) and isinstance(x.value, str) and x.value.lower() in _BF16_WORDS)
                   or (isinstance(x, (ast.Attribute, ast.Name)) and ctx.qualname(x) == "torch.bfloat16")
                   for x in ast.walk(n))

    def positive(n: ast.AST) -> bool:
        if isinstance(n, ast.BoolOp):
            return any(positive(v) for v in n.values)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            return False
        if isinstance(n, ast.Compare):
            return names_bf16(n) and not any(isinstance(o, (ast.NotEq, ast.IsNot, ast.NotIn)) for o in n.ops)
        if not isinstance(n, (ast.Attribute, ast.Name)):
            return False
        if ctx.qualname(n) == "torch.bfloat16":
            return True
        last = n.attr if isinstance(n, ast.Attribute) else n.id
        return last in _BF16_FLAGS and not (ctx.qualname(n) or "").startswith("torch.")

    return positive(test)


_FINFO_FLOAT32 = {"min": -float(np.finfo(np.float32).max), "max": float(np.finfo(np.float32).max)}


def _const_value(node: ast.AST) -> float | None:
    """A literal number, or ``torch.finfo(torch.float32).min/max`` (float32's extremes, which a
    float16 tensor cannot hold)."""
    if (isinstance(node, ast.Attribute) and node.attr in _FINFO_FLOAT32 and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "finfo"
            and node.value.args and dotted(node.value.args[0]) in ("torch.float32", "torch.float")):
        return _FINFO_FLOAT32[node.attr]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _const_value(node.operand)
        return -v if v is not None else None
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return float(node.value)
    return None


@per_module
def _fp16_evidence(ctx: FileContext) -> bool:
    """This module trains in float16 (autocast's float16, or a float16 training cast), or,
    when it says nothing itself, a project module that imports it does (model code whose
    precision the training script decides)."""
    def own(c: FileContext) -> bool:
        return bool(c.fp16_autocast) or any(c.lowp_cast_dtype(x) == "float16" for x in training_lowp_casts(c))
    if own(ctx):
        return True
    if ctx.autocast_scopes or ctx.manual_lowp_casts:
        return False  # this module decides its own precision, and it is not float16
    return any(own(m) for m in ctx.project.users_of(ctx) if m is not ctx)


def _callee(ctx: FileContext, call: ast.Call) -> str:
    """The called name's last part, for a method of any receiver (``x.mean(-1).masked_fill``)."""
    name = ctx.call_name(call) or (call.func.attr if isinstance(call.func, ast.Attribute) else "")
    return name.rsplit(".", 1)[-1]


def _fp16_confidence(ctx: FileContext, node: ast.AST | None = None,
                     library: bool = True) -> tuple[Confidence, str]:
    """How sure we are that this module's code runs in float16, and a note when not sure.
    ``library``: a model library's users choosing float16 counts (MEDIUM); not for a pattern
    that needs the training to be seen to mean anything."""
    scope = ctx.scope_of(node) if node is not None else None
    if (scope is not None and scope.enabled and scope.dtype == FLOAT16) or trains_in(ctx, FLOAT16):
        return Confidence.HIGH, ""
    if any(FLOAT16 in own_precisions(m) for m in ctx.project.program_modules(ctx)):
        return Confidence.MEDIUM, " (float16 training elsewhere in the project)"
    if library and in_model_library(ctx):
        return Confidence.MEDIUM, LIBRARY_NOTE.format(why="float16 is one they use")
    return Confidence.LOW, NO_TRAINING_NOTE.format(why="float16").replace(
        "no training seen; if this runs under AMP, float16", "no float16 training seen; if this trains in float16")


def upcast_in(ctx: FileContext, expr: ast.AST) -> bool:
    """``expr`` is made float32 (or wider) on the way: ``.float()``, ``.double()``, ``.to(torch.float32)``."""
    return any(is_float32_cast(ctx, n) for n in ast.walk(expr))


def names_in(expr: ast.AST) -> list[str]:
    """The last part of every name and attribute in ``expr`` (``self.inv_freq[None]`` -> inv_freq)."""
    return [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(expr)
            if isinstance(n, (ast.Name, ast.Attribute))]


def test_module(ctx: FileContext) -> bool:
    """A test file (``test_*.py``, or under ``tests/``): what it casts or loads says nothing of
    how the project trains."""
    parts = ctx.path.replace("\\", "/").split("/")
    return parts[-1].startswith("test_") or any(p in ("tests", "test") for p in parts[:-1])


def in_parameter(ctx: FileContext, node: ast.AST) -> bool:
    """``node`` is part of a ``Parameter(...)`` call: what it makes is a trained weight."""
    return any(isinstance(a, ast.Call) and (ctx.call_name(a) or "").endswith("Parameter")
               for a in [node, *ctx.parents_chain(node)])


def plain_torch_scalers(ctx: FileContext) -> list[ast.Call]:
    """``torch...GradScaler(...)`` calls of this module that are not the sharded one."""
    return [c for c in ctx.calls if (q := ctx.qualname(c.func) or "").startswith("torch.")
            and av.is_scaler_class(q) and not q.endswith("ShardedGradScaler")]


def number_in(ctx: FileContext, expr: ast.AST, cls: ast.ClassDef | None = None,
              fn: ast.AST | None = None) -> float | None:
    """The number ``expr`` stands for: a literal (negated too: ``-NEAR_INF``); with ``cls``,
    ``self.<attr>`` set to one in the class (or to an ``__init__`` parameter whose default is one);
    with ``fn``, a name given one literal in ``fn`` (``eps = 1e-8``, ``alpha, eps = 0.25, 1e-8``) or
    else at module level, or, when ``fn`` never rebinds it, its parameter default
    (``mask_fill_value: float = -1e32``) or a constant imported from a project module."""
    v = _const_value(expr)
    if v is not None:
        return v
    if cls is not None and isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) \
            and expr.value.id == "self":
        return _class_attr_number(ctx, cls, expr.attr)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):  # -NEAR_INF
        v = number_in(ctx, expr.operand, cls=cls, fn=fn)
        return -v if v is not None else None
    if fn is not None and isinstance(expr, ast.Name):
        found = _name_number(ctx, fn, expr.id)
        if found is None and not assigned_values(ctx, fn, {expr.id}):
            found = _default_number(fn, expr.id)
            found = found if found is not None else _imported_number(ctx, expr.id)
        return found
    return None


def assigned_values(ctx: FileContext, fn: ast.AST, names: set[str]) -> list[ast.AST]:
    """What ``fn``'s own scope assigns to any of ``names`` (the evaluator's bindings: ``x = ...``,
    ``a, b = ...`` as an element, ``x: T = ...``; a nested function is its own scope)."""
    scope = ctx.values.scopes.get(fn)
    return [] if scope is None else [expr for name in names for how, expr in scope.names.get(name, ())
                                     if how in ("assign", "unpack")]


def _default_number(fn: ast.AST, name: str) -> float | None:
    """The literal default of ``fn``'s parameter ``name`` (``mask_fill_value: float = -1e32``):
    what the function uses whenever a caller leaves it out."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return None
    a = fn.args
    pos = [*a.posonlyargs, *a.args]
    defaults = dict(zip([p.arg for p in pos][len(pos) - len(a.defaults):], a.defaults))
    defaults.update({k.arg: d for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    return _const_value(defaults[name]) if name in defaults else None


def _imported_number(ctx: FileContext, name: str) -> float | None:
    """A module constant imported from a project module (``from parlai.utils.torch import
    NEAR_INF``), given one literal there."""
    for node in ctx.tree.body:
        alias = next((a for a in node.names if (a.asname or a.name) == name), None) \
            if isinstance(node, ast.ImportFrom) and ctx.project is not None else None
        qualname = ctx.import_qualname(node, name) if alias is not None else None
        source = ctx.project.find_module(qualname.rsplit(".", 1)[0], ctx) if qualname else None
        if source is not None and source is not ctx:
            return _name_number(source, source.tree, alias.name)
    return None


def _class_attr_number(ctx: FileContext, cls: ast.ClassDef, attr: str) -> float | None:
    for value, _ in ctx.values.class_attrs.get(cls, {}).get(attr, []):
        if (c := _const_value(value)) is not None:
            return c
        init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        if isinstance(value, ast.Name) and init is not None and (d := _default_number(init, value.id)) is not None:
            return d
    return None


def _name_number(ctx: FileContext, fn: ast.AST, name: str) -> float | None:
    """The one literal ``name`` is given in ``fn``, else at module level; None if several or none."""
    for scope in (fn, ctx.tree):
        found: list[float | None] = []
        for st in (ast.walk(scope) if scope is fn else scope.body):
            if not isinstance(st, ast.Assign):
                continue
            for t in st.targets:
                if isinstance(t, ast.Name) and t.id == name:
                    found.append(_const_value(st.value))
                elif isinstance(t, ast.Tuple) and isinstance(st.value, ast.Tuple) and len(t.elts) == len(st.value.elts):
                    found += [_const_value(v) for e, v in zip(t.elts, st.value.elts)
                              if isinstance(e, ast.Name) and e.id == name]
        if found:
            return found[0] if len(found) == 1 else None
    return None


def classes_calling(ctx: FileContext, method: str) -> list[ast.ClassDef]:
    """The classes whose code calls ``<x>.<method>(...)``, innermost class of each call, in
    source order: the few a per-class check needs to walk."""
    out: dict[int, ast.ClassDef] = {}
    for c in ctx.calls:
        if isinstance(c.func, ast.Attribute) and c.func.attr == method:
            cls = ctx.values.enclosing_class(c)
            if cls is not None:
                out.setdefault(id(cls), cls)
    return sorted(out.values(), key=lambda n: n.lineno)


def registered_buffers(cls: ast.ClassDef) -> dict[str, ast.AST]:
    """``self.register_buffer("k", <value>)`` in the class: buffer name -> the value it starts as."""
    out = {}
    for c in ast.walk(cls):
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "register_buffer" \
                and len(c.args) >= 2 and isinstance(c.args[0], ast.Constant) and isinstance(c.args[0].value, str):
            out[c.args[0].value] = c.args[1]
    return out
