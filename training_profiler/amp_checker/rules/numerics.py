"""Numbers a low precision cannot hold: a constant beyond float16's range (AMP011), an optimizer
eps that rounds to zero (AMP012), normalization statistics in the input's precision (AMP016)."""
from __future__ import annotations

import ast
import re

from quant.vocabulary import FLOAT16, Severity
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import is_float32_cast, per_module, training_lowp_casts
from training_profiler.amp_checker.precision import (
    expects_lowp_activations,
    lowp_parameters,
    own_precisions,
)
from training_profiler.amp_checker.rules.base import Confidence, Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import (
    FP16_MAX,
    FP16_MIN_NORMAL,
    FP16_MIN_SUBNORMAL,
    _callee,
    _const_value,
    _fp16_confidence,
    _fp16_evidence,
    _has_kw,
    number_in,
)

_STAT_CALLS = {"mean", "var", "var_mean", "std", "std_mean"}


def _squares_or_input(node: ast.AST, params: set[str]) -> str | None:
    """The forward input a statistic reads: ``x``, ``x * x``, ``x ** 2``, ``x.pow(2)``,
    ``x.square()``; None when it is cast (``x.float()``) or reads something else."""
    if isinstance(node, ast.Name):
        return node.id if node.id in params else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Pow)):
        return _squares_or_input(node.left, params)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("pow", "square"):
        return _squares_or_input(node.func.value, params)
    return None


@declare_rule(
    "AMP016", "norm-stats-in-input-precision", Severity.MEDIUM,
    explanation=(
        "A normalization that squares its input in float16/bfloat16 before averaging loses the "
        "statistic (squares overflow float16 past 256; bfloat16 keeps 8 significant bits), and "
        "an eps below float16's normal range (6.1e-5) added to a float16 variance does not keep "
        "rsqrt finite; the reciprocal square root amplifies either error."),
    suggestion=(
        "Compute the statistics in float32 (x.float().pow(2).mean(...)) and cast back, or use "
        "eps >= 1e-3 when the input is not float32."))
class NormStatsInInputPrecision(RuleVisitor):
    """A normalization layer's forward (it takes a reciprocal square root) that either squares
    its input in the input's dtype before averaging (float16 squares overflow past 256,
    bfloat16's mean keeps 8 bits: litgpt's RMSNorm, detectron2's SyncBatchNorm), or adds to a
    variance in the input's dtype an eps that float16 cannot hold as a normal number (imagen's
    LayerNorm with eps=1e-5). torch's reductions accumulate in float32 internally, so a plain
    variance is not the hazard; its eps is. Model code's dtype is usually its callers' choice:
    without low precision among the code that uses it, the finding says so."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        ctx = self.ctx
        cls = ctx.parents.get(node)
        if node.name == "forward" and isinstance(cls, ast.ClassDef) and any(
                isinstance(c, ast.Call) and ((ctx.call_name(c) or "").rsplit(".", 1)[-1] in ("rsqrt", "sqrt")
                                             or isinstance(c.func, ast.Attribute) and c.func.attr in ("rsqrt", "sqrt"))
                for c in ast.walk(node)):
            params = {a.arg for a in node.args.args[1:]}
            upcast = {t.id for st in ast.walk(node) if isinstance(st, ast.Assign) and is_float32_cast(self.ctx, st.value)
                      for t in st.targets if isinstance(t, ast.Name)}
            note = _lowp_note(ctx)
            conf = Confidence.MEDIUM if note == _UNKNOWN_NOTE else Confidence.HIGH
            for c in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                q = ctx.call_name(c) or ""
                method = isinstance(c.func, ast.Attribute) and c.func.attr in _STAT_CALLS and not q.startswith("torch.")
                if not (method or (q.startswith("torch.") and q.rsplit(".", 1)[-1] in _STAT_CALLS)) or _has_kw(c, "dtype"):
                    continue
                operand = c.func.value if method else (c.args[0] if c.args else None)
                x = _squares_or_input(operand, params) if operand is not None else None
                if x is None or x in upcast:
                    continue
                what = c.func.attr if isinstance(c.func, ast.Attribute) else q.rsplit(".", 1)[-1]
                if what in ("mean", "sum") and not isinstance(operand, ast.Name):
                    self.report(c, f"{what}() of `{ast.unparse(operand)}`: squares taken in the input's "
                                   f"precision before rsqrt{note}", conf)
                elif what.startswith(("var", "std")):
                    eps = _eps_added_to(ctx, node, cls, c)
                    if eps is not None and 0 < eps < FP16_MIN_NORMAL:
                        self.report(c, f"{what}() in the input's precision plus eps={eps:g}, below "
                                       f"float16's smallest normal ({FP16_MIN_NORMAL:.3g}){note}", conf)
        self.generic_visit(node)


def _eps_added_to(ctx: FileContext, fn: ast.FunctionDef, cls: ast.ClassDef, stat: ast.Call) -> float | None:
    """The constant added to the variance ``stat`` computes (``var + self.eps`` with
    ``self.eps = eps`` and ``eps=1e-5`` in ``__init__``); None when it is not one number."""
    stmt = ctx.parents.get(stat)
    names = {t.id for t in getattr(stmt, "targets", []) if isinstance(t, ast.Name)}
    for n in ast.walk(fn):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
            sides = (n.left, n.right)
            if any((isinstance(x, ast.Name) and x.id in names) or x is stat for x in sides):
                other = n.right if (n.left is stat or (isinstance(n.left, ast.Name) and n.left.id in names)) else n.left
                return number_in(ctx, other, cls=cls)
    return None


@per_module
def _lowp_note(ctx: FileContext) -> str:
    """Low precision here (a cast, an autocast) or in the code that uses this module: no note;
    this module's code testing for float16 tensors: that test; else the dtype is unknown."""
    if ctx.uses_lowp or any(m.uses_lowp or m.library_amp for m in ctx.project.users_of(ctx)):
        return ""
    return expects_lowp_activations(ctx) or _UNKNOWN_NOTE


_UNKNOWN_NOTE = " (its dtype is decided by the model's callers: unknown)"  # MEDIUM confidence


_FILL_CALLS = ("masked_fill", "masked_fill_", "fill_", "full", "full_like", "new_full", "clamp",
               "clamp_", "where")


@declare_rule(
    "AMP011", "fp16-unsafe-constant", Severity.MEDIUM,
    explanation=(
        "A constant beyond ±65504 becomes ±inf in float16; -1e9 attention masks give NaN rows "
        "after softmax."),
    suggestion="Use torch.finfo(x.dtype).min / max instead of a fixed constant.")
class Fp16UnsafeConstant(RuleVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = (ctx.call_name(node) or "").split(".")[-1]
        if name in _FILL_CALLS and _fp16_evidence(ctx):
            fn, cls = ctx.enclosing_function(node), ctx.values.enclosing_class(node)
            for a in list(node.args) + [k.value for k in node.keywords]:
                v = number_in(ctx, a, cls=cls, fn=fn)
                if v is not None and abs(v) > FP16_MAX:
                    self.report(a, f"constant {v:g} in {name}() is outside the float16 range (±{FP16_MAX:g})")
        self.generic_visit(node)


# ---- AMP011 / AMP012 against the training precision -------------------------------------------
def _mentions_mask(expr: ast.AST) -> bool:
    return any(isinstance(n, (ast.Name, ast.Attribute)) and re.search(r"mask|bias", dotted(n) or "", re.I)
               for n in ast.walk(expr))


class MaskConstantAgainstTraining(RuleVisitor):
    """A fill (``masked_fill(m, -1e9)``) or an additive mask (``(1 - mask) * -1e10``) beyond
    float16's range, in code that trains in float16 by any means (``torch_dtype=``, ``.half()``,
    autocast, a trainer's fp16 flag), here or in a module that uses this one."""

    def run(self):
        ctx = self.ctx
        if _fp16_evidence(ctx) or (own_precisions(ctx) and FLOAT16 not in own_precisions(ctx)):
            return self.hits  # AMP011 itself judged this module, or it trains in bfloat16
        for n in ctx.nodes:
            consts: list[ast.AST] = []
            if isinstance(n, ast.Call) and _callee(ctx, n) in _FILL_CALLS:
                consts = [*n.args, *(k.value for k in n.keywords)]
                where = _callee(ctx, n) + "()"
            elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult) and _mentions_mask(n):
                consts, where = [n.left, n.right], "an additive mask"
            if not consts:
                continue
            fn, cls = ctx.enclosing_function(n), ctx.values.enclosing_class(n)
            for a in consts:
                v = number_in(ctx, a, cls=cls, fn=fn)
                if v is not None and abs(v) > FP16_MAX:
                    # float32's own limit, named (torch.finfo(torch.float32).min): a float32 tensor by design
                    conf, note = _fp16_confidence(ctx, n, library=not isinstance(a, ast.Attribute))
                    self.report(a, f"constant {v:g} in {where} is outside the float16 range (±{FP16_MAX:g}){note}", conf)
        return self.hits


_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "Adadelta", "RMSprop", "Adamax", "NAdam", "RAdam")


@declare_rule(
    "AMP012", "eps-underflow-fp16", Severity.MEDIUM, training_path=True,
    explanation=(
        "An optimizer eps below float16's smallest subnormal (~6e-8) is zero for float16 "
        "parameters, so the update divides by sqrt(v) alone."),
    suggestion=(
        "Keep float32 master weights (autocast + GradScaler), or use eps >= 1e-4 with float16 parameters."))
class EpsUnderflowFp16(RuleVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        if (ctx.call_name(node) or "").split(".")[-1] in _OPTIMIZERS and any(
                ctx.lowp_cast_dtype(c) == "float16" for c in training_lowp_casts(ctx)):
            for k in node.keywords:
                v = _const_value(k.value) if k.arg == "eps" else None
                if v is not None and 0 < v < FP16_MIN_SUBNORMAL:
                    self.report(k.value, f"optimizer eps={v:g} rounds to 0 in float16 parameters")
        self.generic_visit(node)


# default eps of torch's optimizers (and of transformers' Trainer, which builds AdamW)
_DEFAULT_EPS = {"Adam": 1e-8, "AdamW": 1e-8, "Adamax": 1e-8, "NAdam": 1e-8, "RAdam": 1e-8,
                "RMSprop": 1e-8, "Adagrad": 1e-10}
_TRAINERS = ("Trainer", "Seq2SeqTrainer", "SFTTrainer")
_TRAINER_LIBRARIES = ("transformers.", "trl.")  # whose Trainers build AdamW themselves


class EpsAgainstParameters(RuleVisitor):
    """An Adam-family optimizer (or a library Trainer, which builds AdamW with eps=1e-8) on float16
    parameters (``from_pretrained(torch_dtype=torch.float16)`` or a ``.half()`` model that
    trains), with eps, given or default, below float16's smallest subnormal."""

    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        qualname = ctx.call_name(node) or ""
        name = qualname.split(".")[-1]
        # a library's Trainer builds AdamW itself; a project's own Trainer class (OpenNMT's) does not
        library_trainer = name in _TRAINERS and qualname.startswith(_TRAINER_LIBRARIES)
        if (name in _OPTIMIZERS or library_trainer) and lowp_parameters(ctx) == FLOAT16:
            already = any(ctx.lowp_cast_dtype(c) == FLOAT16 for c in training_lowp_casts(ctx))
            eps_kw = next((k.value for k in node.keywords if k.arg == "eps"), None)
            if library_trainer:
                if not _has_kw(node, "optimizers") and not _trainer_eps_given(ctx):
                    self.report(node, f"{name}'s default AdamW eps=1e-08 rounds to 0 on float16 parameters")
            elif eps_kw is None and name in _DEFAULT_EPS and len(node.args) < 5:
                self.report(node, f"optimizer default eps={_DEFAULT_EPS[name]:g} rounds to 0 in float16 parameters")
            elif eps_kw is not None and not already:
                v = _const_value(eps_kw)
                if v is not None and 0 < v < FP16_MIN_SUBNORMAL:
                    self.report(eps_kw, f"optimizer eps={v:g} rounds to 0 in float16 parameters")
        self.generic_visit(node)


def _trainer_eps_given(ctx: FileContext) -> bool:
    return any(k.arg == "adam_epsilon" for c in ctx.calls for k in c.keywords)


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (Fp16UnsafeConstant.rule, EpsUnderflowFp16.rule, NormStatsInInputPrecision.rule,)
