"""Sums over every token in float16 (AMP019): linear attention's ``k^T v`` context and its
normaliser, a bug kind public projects fixed."""
from __future__ import annotations

import ast
import re

from quant.vocabulary import FLOAT16, Severity
from training_profiler.amp_checker.context import dotted
from training_profiler.amp_checker.intent import is_float32_cast
from training_profiler.amp_checker.rules.base import Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import _const_value, _fp16_confidence, _has_kw


def _transposed_name(expr: ast.AST) -> str | None:
    """``k.transpose(-2, -1)`` / ``k.mT`` / ``k.T`` -> 'k'."""
    if isinstance(expr, ast.Attribute) and expr.attr in ("mT", "T"):
        return dotted(expr.value)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "transpose" \
            and len(expr.args) == 2 and {_const_value(a) for a in expr.args} == {-2.0, -1.0}:
        return dotted(expr.func.value)
    return None


_VALUES = re.compile(r"^v(alues?)?$", re.I)
_KEYS = re.compile(r"^k(eys?)?$", re.I)


def _transposed_through(fn: ast.AST, expr: ast.AST) -> str | None:
    """:func:`_transposed_name`, also through a name the function bound to a transpose
    (``trans_k = k.transpose(-1, -2)``; ``torch.matmul(trans_k, v)``)."""
    found = _transposed_name(expr)
    if found or not isinstance(expr, ast.Name):
        return found
    bound = [st.value for st in ast.walk(fn) if isinstance(st, ast.Assign) and len(st.targets) == 1
             and isinstance(st.targets[0], ast.Name) and st.targets[0].id == expr.id]
    return _transposed_name(bound[0]) if len(bound) == 1 else None


def _context_operand(fn: ast.AST, left: ast.AST, right: ast.AST) -> str | None:
    """The keys of a linear-attention context: ``k^T @ v`` (tokens first), or ``v @ k^T`` with
    tokens last (channel-first layouts: efficientvit's LiteMLA); the second only when the names
    say values and keys, since ``q @ k^T`` is ordinary attention's score, a sum over the head."""
    keys = _transposed_through(fn, left)
    if keys:
        return keys
    keys = _transposed_through(fn, right)
    values = (dotted(left) or "").rsplit(".", 1)[-1]
    if keys and _VALUES.match(values) and _KEYS.match(keys.rsplit(".", 1)[-1].removeprefix("trans_")):
        return keys
    return None


def _einsum_context(spec: str) -> bool:
    """'...nd,...ne->...de': one index summed, the second-to-last of both inputs."""
    m = re.fullmatch(r"\s*([\w.]+)\s*,\s*([\w.]+)\s*->\s*([\w.]+)\s*", spec)
    if not m:
        return False
    a, b, out = (s.replace("...", "") for s in m.groups())
    summed = (set(a) & set(b)) - set(out)
    return len(a) >= 2 and len(b) >= 2 and summed == {a[-2]} and b[-2] == a[-2] and out.endswith(a[-1] + b[-1])


@declare_rule(
    "AMP019", "long-reduction-in-fp16", Severity.MEDIUM, training_path=True,
    explanation=(
        "Linear attention sums k^T v and k over every token; in float16 these sums pass 65504 on long "
        "sequences (inf, then NaN after the normalising division)."),
    suggestion=(
        "Compute the context and the normaliser in float32 (k.float(), v.float()) or under "
        "autocast(enabled=False), and cast the output back."))
class LinearAttentionSum(RuleVisitor):
    """``k^T v`` (and ``k.sum(dim=-2)``, its normaliser) sums over every token: in float16 the
    result passes 65504 on long sequences (linear attention's context and denominator)."""

    def run(self):
        ctx = self.ctx
        for n in ctx.nodes:
            left = None
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
                left = _context_operand(ctx.enclosing_function(n), n.left, n.right)
            elif isinstance(n, ast.Call) and (ctx.call_name(n) or "").rsplit(".", 1)[-1] in ("matmul", "bmm") \
                    and len(n.args) == 2:
                left = _context_operand(ctx.enclosing_function(n), n.args[0], n.args[1])
            elif isinstance(n, ast.Call) and (ctx.call_name(n) or "").endswith("einsum") and len(n.args) == 3 \
                    and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str) \
                    and _einsum_context(n.args[0].value):
                left = dotted(n.args[1])
            if not left or not self._low_precision_here(n):
                continue
            # a transposed product is also a weight-space one (LoRA's B.T @ B, a weight gradient):
            # only training seen in float16 makes it a sequence sum worth reporting
            conf, note = _fp16_confidence(ctx, n, library=False)
            self.report(n, f"`{ast.unparse(n)[:50]}` sums over the sequence (linear attention's context){note}", conf)
            fn = ctx.enclosing_function(n)
            for s in ast.walk(fn):
                if isinstance(s, ast.Call) and isinstance(s.func, ast.Attribute) and s.func.attr == "sum" \
                        and dotted(s.func.value) == left and _sums_sequence(s) and not _has_kw(s, "dtype"):
                    self.report(s, f"`{ast.unparse(s)[:50]}` sums `{left}` over the sequence (the normaliser){note}", conf)
        return self.hits

    def _low_precision_here(self, node: ast.AST) -> bool:
        """Not an upcast product, not under a bfloat16 or float32 autocast."""
        scope = self.ctx.scope_of(node)
        if scope is not None and scope.enabled and scope.dtype != FLOAT16:
            return False
        return not any(is_float32_cast(self.ctx, x) for x in ast.walk(node))


def _sums_sequence(call: ast.Call) -> bool:
    dims = [*call.args[:1], *(k.value for k in call.keywords if k.arg == "dim")]
    return any(_const_value(d) == -2.0 for d in dims)


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (LinearAttentionSum.rule,)
