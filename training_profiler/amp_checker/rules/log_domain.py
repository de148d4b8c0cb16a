"""AMP031: a logarithm that float16 turns into -inf.

Two shapes of one hazard. ``log(sigmoid(x))`` and ``log(softmax(x))`` take the log of a
probability that float16 has already rounded to zero: sigmoid(x) is below float16's smallest
subnormal (~6e-8) from x = -17 on, so a reward model's ``log(sigmoid(chosen - rejected))`` is -inf
for a clear preference (DeepSpeed-Chat, fixed 2023 with ``logsigmoid``). And ``log(p + 1e-8)``:
an eps below that subnormal is zero in float16, so it guards nothing when p is 0 (a matcher's
focal cost ``-(1 - p + 1e-8).log()``, fixed with 1e-5 in MaskDINO).
"""
from __future__ import annotations

import ast
import re

from quant.vocabulary import Severity
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.rules.base import Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import (
    FP16_MIN_SUBNORMAL,
    _fp16_confidence,
    number_in,
    upcast_in,
)

#: a probability's op -> the fused log-domain op that does not round it to zero first
_FUSED = {"sigmoid": "F.logsigmoid(x)", "softmax": "F.log_softmax(x, dim)"}
#: names of values that can be exactly zero: what an eps in a log guards
_PROBABILITY_NAME = re.compile(r"prob|score|conf|likel|^p$|^p_|_p$|^q$", re.I)


def _log_operand(ctx: FileContext, call: ast.Call) -> ast.AST | None:
    """What ``torch.log(x)`` / ``x.log()`` takes the log of."""
    if (ctx.qualname(call.func) or "") == "torch.log" and call.args:
        return call.args[0]
    if isinstance(call.func, ast.Attribute) and call.func.attr == "log" and not call.args \
            and not (ctx.qualname(call.func) or "").startswith(("math.", "numpy.", "np.")):
        return call.func.value
    return None


def _probability(ctx: FileContext, expr: ast.AST) -> str | None:
    """'sigmoid'/'softmax' when ``expr`` is one made in its input's dtype (no ``dtype=``)."""
    if not isinstance(expr, ast.Call) or any(k.arg == "dtype" for k in expr.keywords):
        return None
    name = (ctx.qualname(expr.func) or dotted(expr.func) or "").rsplit(".", 1)[-1]
    return name if name in _FUSED else None


def _a_probability(ctx: FileContext, expr: ast.AST) -> bool:
    """``expr`` holds a probability: a sigmoid/softmax, or a name that says so (``out_prob``,
    ``p``, ``scores``); a noise level or a length is not one (``log(sigmas + 1e-44)``)."""
    return any(_probability(ctx, n) or (isinstance(n, ast.Name) and _PROBABILITY_NAME.search(n.id))
               or (isinstance(n, ast.Attribute) and _PROBABILITY_NAME.search(n.attr)) for n in ast.walk(expr))


def _terms(expr: ast.AST) -> list[ast.AST]:
    """The operands of a chain of additions (``1 - p + 1e-8`` -> ``1 - p``, ``1e-8``)."""
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return _terms(expr.left) + _terms(expr.right)
    return [expr]


@declare_rule(
    "AMP031", "log-underflow-fp16", Severity.MEDIUM, training_path=True,
    explanation=("A log of a probability made first (log(sigmoid(x)), log(softmax(x))) or guarded by an eps below "
                 "float16's smallest subnormal (log(p + 1e-8)): float16 rounds the probability, or the eps, to zero "
                 "and the log is -inf (sigmoid(x) is zero in float16 from x = -17 on)."),
    suggestion=("Use the fused op: F.logsigmoid(x), F.log_softmax(x, dim); or an eps float16 holds (>= 1e-7, "
                "better 1e-6), or compute in float32 (p.float())."))
class LogUnderflowFp16(RuleVisitor):
    """``torch.log`` / ``.log()`` of a sigmoid or softmax made without ``dtype=``, or of a
    probability (a sigmoid/softmax, or a name that says so) plus a constant (``helpers.number_in``:
    a literal, a name given one literal, a ``self`` attribute set to one) between 0 and float16's
    smallest subnormal; not upcast on the way (``1 - p.float() + 1e-8``), and not a softmax's probabilities in a module that uses
    autocast, which makes them float32. Confidence from where float16 is seen
    (``helpers._fp16_confidence``)."""

    def run(self):
        ctx = self.ctx
        for call in ctx.calls:
            operand = _log_operand(ctx, call)
            if operand is None:
                continue
            terms = _terms(operand)
            prob = next((p for t in terms if (p := _probability(ctx, t))), None)
            fn = ctx.enclosing_function(call)
            cls = ctx.values.enclosing_class(call)
            eps = next((v for t in terms[1:] if (v := number_in(ctx, t, cls=cls, fn=fn)) is not None
                        and 0 < v < FP16_MIN_SUBNORMAL), None) if len(terms) > 1 and _a_probability(
                ctx, terms[0]) else None
            if (prob is None and eps is None) or upcast_in(ctx, operand):
                continue
            if ctx.autocast_scopes and any(_probability(ctx, n) == "softmax" for t in terms for n in ast.walk(t)):
                continue  # autocast computes softmax in float32: its probabilities are not float16
            conf, note = _fp16_confidence(ctx, call)
            if prob is not None:
                what = f"log of a {prob} computed first: float16 rounds it to zero (sigmoid from x = -17), " \
                       f"so the log is -inf; {_FUSED[prob]} does not"
            else:
                what = f"log(... + {eps:g}): an eps below float16's smallest subnormal ({FP16_MIN_SUBNORMAL:.1e}) is " \
                       "zero in float16, so a zero probability still gives -inf"
            self.report(call, what + note, conf)
        return self.hits


RULES: tuple[Rule, ...] = (LogUnderflowFp16.rule,)
