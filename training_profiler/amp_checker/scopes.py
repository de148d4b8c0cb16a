"""Scopes of one module: which expressions each name is bound to, per module / function / lambda
body, and what ``self.x = ...`` sets per class. ``values.Evaluator`` reads these bindings
flow-insensitively to say what a name holds."""
from __future__ import annotations

import ast
from typing import Iterable


class Bindings:
    """name -> the expressions bound to it in one scope (module, function or lambda body)."""

    def __init__(self, node: ast.AST, parent: "Bindings | None") -> None:
        self.node = node
        self.parent = parent
        self.names: dict[str, list[tuple[str, ast.AST]]] = {}

    def add(self, name: str, how: str, expr: ast.AST) -> None:
        self.names.setdefault(name, []).append((how, expr))

    def lookup(self, name: str) -> tuple["Bindings", list[tuple[str, ast.AST]]] | None:
        b: Bindings | None = self
        while b is not None:
            if name in b.names:
                return b, b.names[name]
            b = b.parent
        return None


def dotted(expr: ast.AST) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
        return ".".join(reversed(parts))
    return None


def _target_names(target: ast.AST) -> Iterable[ast.Name]:
    if isinstance(target, ast.Name):
        yield target
    elif isinstance(target, (ast.Tuple, ast.List)):
        for e in target.elts:
            yield from _target_names(e)
    elif isinstance(target, ast.Starred):
        yield from _target_names(target.value)


class ScopeBuilder(ast.NodeVisitor):
    """Fills one ``Bindings`` per module/function and records ``self.x = ...`` per class."""

    def __init__(self, tree: ast.Module) -> None:
        self.module = Bindings(tree, None)
        self.of: dict[ast.AST, Bindings] = {tree: self.module}
        self.class_attrs: dict[ast.ClassDef, dict[str, list[tuple[ast.AST, Bindings]]]] = {}
        self._stack = [self.module]
        self._class: list[ast.ClassDef | None] = [None]
        self.visit(tree)

    @property
    def cur(self) -> Bindings:
        return self._stack[-1]

    def _bind_target(self, target: ast.AST, how: str, value: ast.AST) -> None:
        if isinstance(target, ast.Name):
            self.cur.add(target.id, how, value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            flat = all(isinstance(e, ast.Name) for e in target.elts)
            for i, n in enumerate(_target_names(target)):
                if flat and how == "assign":  # ``a, b = f()``: a is element 0 of what f returns
                    self.cur.add(n.id, "unpack", ast.copy_location(
                        ast.Subscript(value=value, slice=ast.Constant(i), ctx=ast.Load()), value))
                else:
                    self.cur.add(n.id, "unknown", value)
        elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
              and target.value.id == "self" and self._class[-1] is not None):
            attrs = self.class_attrs.setdefault(self._class[-1], {})
            attrs.setdefault(target.attr, []).append((value, self.cur))

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._bind_target(t, "assign", node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._bind_target(node.target, "assign", node.value)
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._bind_target(node.target, "assign", node.value)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        for n in _target_names(node.target):
            self.cur.add(n.id, "unknown", node.iter)
        self.generic_visit(node)

    visit_AsyncFor = visit_For

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            if item.optional_vars is not None:
                for n in _target_names(item.optional_vars):
                    self.cur.add(n.id, "with_as", item.context_expr)
        self.generic_visit(node)

    visit_AsyncWith = visit_With

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.cur.add(a.asname or a.name.split(".")[0], "import", node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            if a.name != "*":
                self.cur.add(a.asname or a.name, "import", node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        if not isinstance(node, ast.Lambda):
            self.cur.add(node.name, "def", node)
            for d in node.decorator_list:
                self.visit(d)
        b = Bindings(node, self.cur)
        self.of[node] = b
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        for i, a in enumerate(positional):
            b.add(a.arg, "param", node)
        for a in [*args.kwonlyargs, *( [args.vararg] if args.vararg else []),
                  *([args.kwarg] if args.kwarg else [])]:
            b.add(a.arg, "param", node)
        self._stack.append(b)
        self._class.append(self._class[-1] if not isinstance(node, ast.Lambda) else self._class[-1])
        body = node.body if isinstance(node.body, list) else [node.body]
        for stmt in body:
            self.visit(stmt)
        self._stack.pop()
        self._class.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function
    visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.cur.add(node.name, "class", node)
        for d in [*node.decorator_list, *node.bases]:
            self.visit(d)
        self.class_attrs.setdefault(node, {})
        self._class.append(node)
        for stmt in node.body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                value = stmt.value
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    if isinstance(t, ast.Name) and value is not None:
                        self.class_attrs[node].setdefault(t.id, []).append((value, self.cur))
            self.visit(stmt)
        self._class.pop()
