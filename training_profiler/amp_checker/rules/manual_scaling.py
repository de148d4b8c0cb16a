"""AMP022: hand-written loss scaling that leaves the scale on some gradients.

Trainers that keep float32 master weights for a float16 model often scale the loss themselves
(``(loss * 2 ** lg_loss_scale).backward()``) and divide the scale out before the step. A
division applied to one indexed parameter (``master_params[0].grad.mul_(1 / scale)``) instead
of every parameter leaves all the others stepping with gradients multiplied by the scale
(guided-diffusion fixed exactly this).
"""
from __future__ import annotations

import ast
import re

from quant.vocabulary import Severity
from training_profiler.amp_checker.rules.base import Rule, RuleVisitor, declare_rule

_SCALE_NAME = re.compile(r"scal", re.I)


def _one_element_grad(target: ast.AST) -> str | None:
    """``params[0].grad`` / ``params[0].grad.data``: the list's element ``params[0]``."""
    while isinstance(target, ast.Attribute) and target.attr == "data":
        target = target.value
    if isinstance(target, ast.Attribute) and target.attr == "grad" and isinstance(target.value, ast.Subscript) \
            and isinstance(target.value.slice, ast.Constant) and isinstance(target.value.slice.value, int):
        return ast.unparse(target.value)
    return None


@declare_rule(
    "AMP022", "partial-manual-unscale", Severity.HIGH, training_path=True,
    explanation=("A hand-written loss-scaling trainer removes the scale from one parameter's gradient (an "
                 "indexed element, outside a loop): the optimizer steps every other parameter with gradients "
                 "still multiplied by the loss scale."),
    suggestion=("Unscale every gradient (`for p in params: p.grad.mul_(1.0 / scale)`), or use "
                "torch.amp.GradScaler and scaler.unscale_(optimizer)."))
class PartialManualUnscale(RuleVisitor):
    """``master_params[0].grad.mul_(1.0 / 2 ** self.lg_loss_scale)`` outside a loop: the loss
    scale leaves one parameter's gradient only."""

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("mul_", "div_") and node.args \
                and _SCALE_NAME.search(ast.unparse(node.args[0])):
            element = _one_element_grad(f.value)
            in_loop = any(isinstance(p, (ast.For, ast.comprehension, ast.While)) for p in self.ctx.parents_chain(node))
            if element and not in_loop:
                self.report(node, f"the loss scale is divided out of `{element}.grad` only; the other "
                                  "parameters keep scaled gradients")
        self.generic_visit(node)


RULES: tuple[Rule, ...] = (PartialManualUnscale.rule,)
