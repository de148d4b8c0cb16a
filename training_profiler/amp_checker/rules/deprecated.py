"""The deprecated ``torch.cuda.amp`` / ``torch.cpu.amp`` names in live code (AMP007)."""
from __future__ import annotations

import ast

from quant.vocabulary import Severity
from training_profiler.amp_checker.context import FileContext
from training_profiler.amp_checker.rules.base import Rule, RuleVisitor, declare_rule

_DEPRECATED = {
    "torch.cuda.amp.autocast": 'torch.amp.autocast("cuda", ...)',
    "torch.cuda.amp.GradScaler": 'torch.amp.GradScaler("cuda", ...)',
    "torch.cuda.amp.custom_fwd": 'torch.amp.custom_fwd(device_type="cuda")',
    "torch.cuda.amp.custom_bwd": 'torch.amp.custom_bwd(device_type="cuda")',
    "torch.cpu.amp.autocast": 'torch.amp.autocast("cpu", ...)',
    "torch.cpu.amp.GradScaler": 'torch.amp.GradScaler("cpu", ...)',
}


@declare_rule(
    "AMP007", "deprecated-amp-api", Severity.LOW,
    explanation="torch.cuda.amp.* and torch.cpu.amp.* are deprecated aliases and emit FutureWarning.",
    suggestion=(
        "Use torch.amp.autocast(device_type, ...), torch.amp.GradScaler(device_type) and "
        "torch.amp.custom_fwd/custom_bwd(device_type=...)."))
class DeprecatedAmpApi(RuleVisitor):
    """Live uses only: not in a type annotation, not in the fallback of a ``try`` whose body
    already uses the new API (``except ImportError/AttributeError``), not in the old-torch branch
    of a version or ``hasattr`` check."""

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in ("torch.cuda.amp", "torch.cpu.amp") and not node.level and not _compat_path(self.ctx, node):
            names = [a.name for a in node.names if f"{node.module}.{a.name}" in _DEPRECATED]
            if names:
                self.report(node, f"deprecated import from {node.module}: {', '.join(names)}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        d = ".".join(reversed(_attr_parts(node)))
        q = self.ctx.qualname(node) or ""
        # Report only spelled-out uses (torch.cuda.amp.X); uses of a deprecated name imported
        # above are already covered by the import finding.
        if q in _DEPRECATED and d.count(".") >= 3:
            if not _compat_path(self.ctx, node):
                self.report(node, f"deprecated {q}; use {_DEPRECATED[q]}")
            return
        self.generic_visit(node)


_VERSION_HINTS = ("version", "hasattr", "is_torch", "TORCH_", "torch_version", "getattr")


def _compat_path(ctx: FileContext, node: ast.AST) -> bool:
    child = node
    cur = ctx.parents.get(node)
    while cur is not None:
        if isinstance(cur, (ast.arg, ast.AnnAssign)) and child is getattr(cur, "annotation", None):
            return True
        if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)) and child is cur.returns:
            return True
        if isinstance(cur, ast.ExceptHandler):
            return True  # the old API as a fallback for a failed new one
        if isinstance(cur, (ast.If, ast.IfExp)) and child is not cur.test:
            test = ast.unparse(cur.test)
            if any(h in test for h in _VERSION_HINTS):
                return True
        child, cur = cur, ctx.parents.get(cur)
    return False


def _attr_parts(node: ast.AST) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (DeprecatedAmpApi.rule,)
