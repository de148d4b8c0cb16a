"""What every static-check rule needs to know about one parsed file.

Rules ask three questions again and again: "what is this name really?" (import and alias
resolution), "is this node under autocast, and which one?" (scope tracking), and "does this file
use AMP / low precision at all?". Answering them once here keeps each rule's visitor small.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

# Canonical autocast entry points -> (device when fixed by the name, positional argument names).
_AUTOCAST_APIS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "torch.autocast": (None, ("device_type", "dtype", "enabled", "cache_enabled")),
    "torch.amp.autocast": (None, ("device_type", "dtype", "enabled", "cache_enabled")),
    "torch.amp.autocast_mode.autocast": (None, ("device_type", "dtype", "enabled", "cache_enabled")),
    "torch.cuda.amp.autocast": ("cuda", ("enabled", "dtype", "cache_enabled")),
    "torch.cuda.amp.autocast_mode.autocast": ("cuda", ("enabled", "dtype", "cache_enabled")),
    "torch.cpu.amp.autocast": ("cpu", ("enabled", "dtype", "cache_enabled")),
}
# Autocast's documented default dtype per device.
_DEFAULT_DTYPE = {"cuda": "float16", "cpu": "bfloat16"}
_DTYPE_NAMES = {
    "torch.float16": "float16", "torch.half": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32", "torch.float": "float32",
}
LOWP_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class AmpScope:
    """One autocast region: device ('cuda', 'cpu' or 'unknown'), dtype and whether it is on."""

    device: str
    dtype: str
    enabled: bool
    node: ast.AST


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


class FileContext:
    """Aliases, parents and autocast scopes of one module's AST."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.aliases: dict[str, str] = {}
        self.parents: dict[ast.AST, ast.AST] = {}
        self._scope: dict[ast.AST, AmpScope | None] = {}
        self.autocast_scopes: list[AmpScope] = []
        self._collect_aliases()
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self._annotate(tree, None)
        self.has_gradscaler = any(
            (q := self.qualname(n)) is not None and q.split(".")[-1] in ("GradScaler", "ShardedGradScaler")
            for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute))
        ) or any(
            isinstance(n, ast.ImportFrom) and any(a.name.endswith("GradScaler") for a in n.names)
            for n in ast.walk(tree)
        )
        self.manual_lowp_casts: list[ast.Call] = [
            n for n in ast.walk(tree) if isinstance(n, ast.Call) and self.lowp_cast_dtype(n)
        ]
        # Functions that return autocast results (a `return` under autocast): their calls
        # produce low-precision tensors wherever they are called.
        self.lowp_functions: set[str] = {
            fn.name for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any(isinstance(r, ast.Return) and r.value is not None and self.in_autocast(r)
                    for r in ast.walk(fn))
        }
        self.uses_amp = bool(self.autocast_scopes) or self.has_gradscaler
        self.uses_lowp = self.uses_amp or bool(self.manual_lowp_casts)

    # ---- names -------------------------------------------------------------------------
    def _collect_aliases(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        head = a.name.split(".")[0]
                        self.aliases[head] = head
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if a.name != "*":
                        self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        # Module-level `F = torch.nn.functional` style aliases.
        for node in self.tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)):
                q = self.qualname(node.value)
                if q and q.startswith("torch."):
                    self.aliases[node.targets[0].id] = q

    def qualname(self, expr: ast.AST) -> str | None:
        """Dotted name with its first part resolved through imports (``F.softmax`` ->
        ``torch.nn.functional.softmax``); local names come back as written."""
        d = dotted(expr)
        if d is None:
            return None
        head, _, rest = d.partition(".")
        base = self.aliases.get(head, head)
        return f"{base}.{rest}" if rest else base

    def call_name(self, call: ast.Call) -> str | None:
        return self.qualname(call.func)

    def dtype_of(self, expr: ast.AST | None) -> str | None:
        """'float16' / 'bfloat16' / 'float32' for a dtype expression, 'unknown' otherwise."""
        if expr is None:
            return None
        q = self.qualname(expr)
        return _DTYPE_NAMES.get(q or "", "unknown")

    # ---- autocast scopes ---------------------------------------------------------------
    def autocast_call(self, expr: ast.AST) -> AmpScope | None:
        """The scope an autocast(...) call opens, or None if ``expr`` is not one."""
        if not isinstance(expr, ast.Call):
            return None
        api = _AUTOCAST_APIS.get(self.call_name(expr) or "")
        if api is None:
            return None
        fixed_device, positional = api
        args: dict[str, ast.AST] = dict(zip(positional, expr.args))
        args.update({k.arg: k.value for k in expr.keywords if k.arg})
        device = fixed_device
        if device is None:
            dev = args.get("device_type")
            device = dev.value if isinstance(dev, ast.Constant) and isinstance(dev.value, str) else "unknown"
        dtype = self.dtype_of(args.get("dtype")) or _DEFAULT_DTYPE.get(device, "unknown")
        en = args.get("enabled")
        enabled = not (isinstance(en, ast.Constant) and en.value is False)
        return AmpScope(device, dtype, enabled, expr)

    def _annotate(self, node: ast.AST, scope: AmpScope | None) -> None:
        self._scope[node] = scope
        if isinstance(node, (ast.With, ast.AsyncWith)):
            inner = scope
            for item in node.items:
                self._annotate(item, scope)
                s = self.autocast_call(item.context_expr)
                if s is not None:
                    self.autocast_scopes.append(s)
                    inner = s
            for stmt in node.body:
                self._annotate(stmt, inner)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner = None  # a function body runs where it is called, not where it is defined
            for dec in getattr(node, "decorator_list", []):
                self._annotate(dec, scope)
                s = self.autocast_call(dec)
                if s is not None:
                    self.autocast_scopes.append(s)
                    inner = s
            self._annotate(node.args, scope)
            body = node.body if isinstance(node.body, list) else [node.body]
            for stmt in body:
                self._annotate(stmt, inner)
            return
        for child in ast.iter_child_nodes(node):
            self._annotate(child, scope)

    def scope_of(self, node: ast.AST) -> AmpScope | None:
        return self._scope.get(node)

    def in_autocast(self, node: ast.AST) -> bool:
        s = self._scope.get(node)
        return s is not None and s.enabled

    @property
    def cpu_only_autocast(self) -> bool:
        return bool(self.autocast_scopes) and all(s.device == "cpu" for s in self.autocast_scopes)

    @property
    def fp16_autocast(self) -> list[AmpScope]:
        return [s for s in self.autocast_scopes if s.enabled and s.dtype == "float16"]

    # ---- casts ---------------------------------------------------------------------------
    def lowp_cast_dtype(self, call: ast.Call) -> str | None:
        """'float16'/'bfloat16' when ``call`` is x.half(), x.bfloat16(), x.to(<lowp dtype>)
        or x.type(torch.HalfTensor); else None."""
        f = call.func
        if not isinstance(f, ast.Attribute):
            return None
        if f.attr == "half" and not call.args:
            return "float16"
        if f.attr == "bfloat16" and not call.args:
            return "bfloat16"
        if f.attr == "to":
            cands = list(call.args) + [k.value for k in call.keywords if k.arg == "dtype"]
            for c in cands:
                d = self.dtype_of(c)
                if d in LOWP_DTYPES:
                    return d
        if f.attr == "type" and call.args:
            q = self.qualname(call.args[0]) or ""
            if isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
                q = call.args[0].value
            if q.endswith("HalfTensor"):
                return "float16"
            if q.endswith("BFloat16Tensor"):
                return "bfloat16"
        return None

    def enclosing_function(self, node: ast.AST) -> ast.AST:
        cur = self.parents.get(node)
        while cur is not None and not isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cur = self.parents.get(cur)
        return cur if cur is not None else self.tree
