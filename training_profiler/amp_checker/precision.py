"""Which low precision a module's model trains in, from every place code decides it.

Autocast is one way; real projects also load a model with ``from_pretrained(torch_dtype=
torch.float16)``, call ``model.half()``, hand a library trainer ``TrainingArguments(fp16=True)``
or an ``Accelerator(mixed_precision="fp16")``. Rules that judge a number against a precision (a
-1e9 mask, an optimizer's eps, a long reduction) ask here, and ask the modules that use this one
too: model code rarely says how it is trained.
"""
from __future__ import annotations

import ast

from quant.vocabulary import BFLOAT16, FLOAT16, LOW_PRECISION_DTYPES
from training_profiler.amp_checker.context import MIXED, TRUE, FileContext
from training_profiler.amp_checker.intent import (
    compared_dtypes,
    per_project,
    step_built,
    training_lowp_casts,
    trains,
)

_STRING_DTYPES = {"float16": FLOAT16, "fp16": FLOAT16, "half": FLOAT16, "bfloat16": BFLOAT16, "bf16": BFLOAT16}
_LOADERS = ("from_pretrained", "from_config", "from_single_file")
_FREEZERS = ("get_peft_model", "prepare_model_for_kbit_training", "prepare_model_for_int8_training")


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _dtype_value(ctx: FileContext, expr: ast.AST | None) -> str | None:
    """'float16' / 'bfloat16' for ``torch.float16``, ``"fp16"``, a variable holding one, either
    branch of a conditional."""
    if expr is None:
        return None
    if isinstance(expr, ast.IfExp):  # `"fp16" if args.fp16 else "no"`: the option's low-precision path
        return _dtype_value(ctx, expr.body) or _dtype_value(ctx, expr.orelse)
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return _STRING_DTYPES.get(expr.value.lower())
    d = ctx.dtype_of(expr)
    return d if d in LOW_PRECISION_DTYPES else None


def _callee(ctx: FileContext, call: ast.Call) -> str:
    return (ctx.call_name(call) or (call.func.attr if isinstance(call.func, ast.Attribute) else "")).rsplit(".", 1)[-1]


def loaded_lowp_models(ctx: FileContext) -> list[tuple[ast.Call, str]]:
    """``from_pretrained(..., torch_dtype=torch.float16)`` calls (``dtype=`` too) and their dtype:
    the model's parameters themselves are in low precision."""
    cached = ctx.facts.get("_fact_loaded_lowp")
    if cached is None:
        cached = []
        for c in ctx.calls:
            if _callee(ctx, c) in _LOADERS:
                d = _dtype_value(ctx, _kw(c, "torch_dtype") or _kw(c, "dtype"))
                if d:
                    cached.append((c, d))
        ctx.facts["_fact_loaded_lowp"] = cached
    return cached


def own_precisions(ctx: FileContext) -> set[str]:
    """The low precisions this module trains in: enabled autocast, a training cast of a model,
    a model loaded in low precision, a trainer's fp16/bf16 flag."""
    cached = ctx.facts.get("_fact_own_precisions")
    if cached is not None:
        return cached
    out = {s.dtype for s in ctx.autocast_scopes if s.enabled and s.dtype in LOW_PRECISION_DTYPES}
    out |= {d for c in training_lowp_casts(ctx) if (d := ctx.lowp_cast_dtype(c))}
    out |= {d for _, d in loaded_lowp_models(ctx)}
    out |= {d for d, how in ctx.library_precisions if how == MIXED}
    ctx.facts["_fact_own_precisions"] = out
    return out


def in_model_library(ctx: FileContext) -> bool:
    """Nothing in the program trains, by any means: a model library (x-transformers, mmcv's
    bricks, fairseq's models) whose users choose the precision it runs in. The scan cannot see
    that choice, only that it is made outside it: MEDIUM confidence by definition."""
    return _model_library(ctx)


@per_project
def _model_library(ctx: FileContext) -> bool:
    """Nothing in ``ctx``'s program trains (answered once per program of the scan)."""
    return not any(_training_signal(m) for m in ctx.project.program_modules(ctx))


def _training_signal(ctx: FileContext) -> bool:
    """Anything that says training happens here, more than a training step the checker follows:
    a training step (``trains``), loss scaling, a backward or an optimizer or GradScaler built
    (``intent.step_built``), a low precision chosen. A demo loop in a library counts too; a
    ``.train()`` / ``.fit()`` call does not (library code defines and forwards them)."""
    return trains(ctx) or bool(ctx.scaler_calls) or step_built(ctx) or bool(own_precisions(ctx))


def trains_in(ctx: FileContext, dtype: str) -> str | None:
    """Where ``dtype`` training is decided for this module's code: 'here', 'users' (a module
    that imports this one, or the rest of its package, trains in it), or None."""
    if dtype in own_precisions(ctx):
        return "here"
    if any(dtype in own_precisions(m) for m in ctx.project.users_of(ctx) if m is not ctx):
        return "users"
    return None


def lowp_parameters(ctx: FileContext) -> str | None:
    """'float16' when this module trains a model whose parameters are float16 (loaded with
    torch_dtype=float16, or cast with .half() for training), not an adapter on a frozen base:
    no float32 master weights, so an optimizer's eps is added in float16."""
    key = "_fact_lowp_parameters"
    if key not in ctx.facts:
        ctx.facts[key] = _lowp_parameters(ctx)
    return ctx.facts[key]


def _lowp_parameters(ctx: FileContext) -> str | None:
    if any(_callee(ctx, c) in _FREEZERS for c in ctx.calls):
        return None
    if any(d == FLOAT16 for _, d in loaded_lowp_models(ctx)) or (FLOAT16, TRUE) in ctx.library_precisions:
        return FLOAT16
    if any(ctx.lowp_cast_dtype(c) == FLOAT16 for c in training_lowp_casts(ctx)):
        return FLOAT16  # a training cast, in a module that trains (not a profiling helper's)
    return None


def activation_dtype_tests(ctx: FileContext) -> dict[str, ast.Compare]:
    """Low precisions this module's own code says its tensors arrive in, each with the first test
    that says so: ``q.dtype in (torch.float16, torch.bfloat16)``, ``if orig_dtype ==
    torch.float16:`` with ``orig_dtype = x.dtype``, in a function (not at import). Code that
    branches on float16 activations is written to run with them, whoever casts the model."""
    key = "_fact_activation_dtype_tests"
    if key not in ctx.facts:
        found: dict[str, ast.Compare] = {}
        for node in ctx.nodes:
            if isinstance(node, ast.Compare) and _tests_a_tensor_dtype(ctx, node):
                for dtype in compared_dtypes(ctx, node) & set(LOW_PRECISION_DTYPES):
                    found.setdefault(dtype, node)
        ctx.facts[key] = found
    return ctx.facts[key]


def _tests_a_tensor_dtype(ctx: FileContext, test: ast.Compare) -> bool:
    """``<tensor>.dtype`` on the left, or a name the same function bound to one."""
    left = test.left
    if isinstance(left, ast.Attribute) and left.attr == "dtype":
        return ctx.enclosing_function(test) is not ctx.tree
    if not isinstance(left, ast.Name):
        return False
    fn = ctx.enclosing_function(test)
    scope = ctx.values.scopes.get(fn) if fn is not ctx.tree else None
    return scope is not None and any(
        how == "assign" and isinstance(expr, ast.Attribute) and expr.attr == "dtype"
        for how, expr in scope.names.get(left.id, []))


def expects_lowp_activations(ctx: FileContext, dtypes: tuple[str, ...] = LOW_PRECISION_DTYPES) -> str | None:
    """A note naming where this module's code tests for one of ``dtypes`` on its tensors, or None."""
    tests = activation_dtype_tests(ctx)
    hit = next((tests[d] for d in dtypes if d in tests), None)
    if hit is None:
        return None
    return f" (this module expects low-precision tensors: `{ast.unparse(hit)}` at line {hit.lineno})"
