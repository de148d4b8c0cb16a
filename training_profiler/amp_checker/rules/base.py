"""What every AMP rule is made of: its visitor base and its declaration.

A rule is a ``RuleVisitor`` subclass with its words (id, name, severity, explanation,
suggestion) declared on the class by ``@declare_rule``, so what a rule says sits beside what it
looks for. Each visitor only reports; filtering (suppression comments, rule selection) happens in
``amp_checker.checker``. Confidence and Finding are
``training_profiler.findings_report``'s, shared with the run-time audit.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Callable, ClassVar

from quant.vocabulary import Severity
from training_profiler.amp_checker.context import FileContext
from training_profiler.findings_report import Confidence, Finding

__all__ = ["Confidence", "Finding", "Rule", "RuleVisitor", "declare_rule", "NO_TRAINING_NOTE",
           "LIBRARY_NOTE"]

NO_TRAINING_NOTE = " (no training seen; if this runs under AMP, {why})"
# nothing in the scan trains at all (precision.in_model_library): the precision is its users'
LIBRARY_NOTE = " (a model library: nothing in the scan trains it, its users pick the precision; {why})"


class RuleVisitor(ast.NodeVisitor):
    """Base visitor: walks the tree and collects (node, message) pairs for its rule."""

    rule: ClassVar[Rule]  # set by @declare_rule on the class that owns a rule

    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx
        self.hits: list[tuple[ast.AST, str, Confidence]] = []

    def report(self, node: ast.AST, message: str, confidence: Confidence = Confidence.HIGH) -> None:
        """A hit at ``confidence`` (a field the rule sets, never read back from the message's
        words): MEDIUM where the precision is decided outside the scan."""
        self.hits.append((node, message, confidence))

    def run(self) -> list[tuple[ast.AST, str, Confidence]]:
        self.visit(self.ctx.tree)
        return self.hits

    # Every rule walks every module, so the walk itself is most of a large scan's time: the same
    # order and the same visit_* dispatch as ast.NodeVisitor, without its per-node generator and
    # its visit_Constant (which only handles the node classes Python 3.8 removed).
    def visit(self, node: ast.AST) -> None:
        method = _DISPATCH.get((type(self), type(node)))
        if method is None:
            method = _DISPATCH[(type(self), type(node))] = getattr(
                type(self), "visit_" + type(node).__name__, type(self).generic_visit)
        method(self, node)

    def generic_visit(self, node: ast.AST) -> None:
        for name in node._fields:
            value = getattr(node, name, None)
            if type(value) is list:
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item)
            elif isinstance(value, ast.AST):
                self.visit(value)

    def visit_Constant(self, node: ast.Constant) -> None:
        """A leaf: nothing under it to visit."""


_DISPATCH: dict[tuple[type, type], Callable[..., None]] = {}


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    severity: Severity
    explanation: str
    suggestion: str
    visitor: type[RuleVisitor]
    # about training numerics or AMP setup (accumulation, loss scaling, casts, averages): at low
    # confidence at most in a file that only runs or times a model (intent.program_purpose)
    training_path: bool = False


def declare_rule(rule_id: str, name: str, severity: Severity, *, explanation: str,
                 suggestion: str, training_path: bool = False
                 ) -> Callable[[type[RuleVisitor]], type[RuleVisitor]]:
    """Class decorator: the rule this visitor checks, written on the visitor so that what the
    rule says (id, name, severity, explanation, suggestion) and what it looks for are read
    together. The class gets it as ``cls.rule``; its family module lists it in ``RULES``.
    ``training_path``: the hazard exists only where the code trains (``Rule.training_path``)."""
    def attach(visitor: type[RuleVisitor]) -> type[RuleVisitor]:
        visitor.rule = Rule(rule_id, name, severity, explanation, suggestion, visitor, training_path)
        return visitor
    return attach
