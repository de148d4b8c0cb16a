"""Process state lives in named objects, not in scattered module globals (issue 42 item 5).

docs/architecture.md: tensor_capture keeps what it holds per process in ``tensor_capture.state``'s
``STATE`` (a slot, or a ``STATE.session(cls)`` part the saver's one reset drops); quant, which
may not import tensor_capture, keeps it in one object per module (``quant.accel.COMPILE``,
``quant.backends.TRITON_KERNELS``). This test reads the source (AST, no imports) of every
library package and fails on:

- a module-level mutable container (a ``{}`` / ``[]`` / set literal or comprehension, or a call
  of ``dict``, ``list``, ``set``, ``WeakSet``, ``Queue``, ``Event``, ...) that a function writes
  (item or slice assignment, ``del``, ``+=``, a mutating method such as ``append`` or
  ``update``): state hidden in a module. A table built at import and only read after is a
  constant and passes without a listing (the scan tells the two apart);
- a ``global`` statement;
- a write into another module's globals (``other.NAME = ...``, ``other.NAME[k] = ...``,
  ``other.NAME.append(...)``, ``setattr(other, ...)``), at import or later.

What is deliberately process-wide is listed in ``ALLOWED`` with its reason; an entry that no
longer matches anything fails too, so the list cannot outlive its reason. Not seen: a write
through an alias (``d = _TABLE; d[k] = v``) or by a callee the container is handed to.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("quant", "tensor_capture", "tensor_viz", "te_integration", "training_driver",
            "training_profiler", "lowp_common", "attribution")

MUTABLE_CALLS = frozenset({
    "dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque",
    "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "Queue", "SimpleQueue",
    "LifoQueue", "PriorityQueue", "Event"})
MUTATORS = frozenset({
    "append", "appendleft", "extend", "extendleft", "insert", "add", "update", "setdefault",
    "pop", "popleft", "popitem", "clear", "remove", "discard", "sort", "reverse", "put",
    "put_nowait", "set", "__setitem__", "__delitem__", "difference_update",
    "intersection_update", "symmetric_difference_update"})

#: (module, name) -> why this module-level state is process-wide on purpose
ALLOWED = {
    ("tensor_capture.recorder.flight", "_LIVE"):
        "weak set of the open flight recorders, closed by the atexit hook beside it",
    ("tensor_capture.writer", "_LIVE"):
        "weak set of the open background writers, flushed by the atexit hook beside it",
    ("tensor_viz.pipeline", "_DRAW_STATE"):
        "a drawing worker process's arguments, set by the pool's initializer in that process",
    ("training_profiler.amp_checker.rules.base", "_DISPATCH"):
        "memo of a pure function: (visitor class, node class) -> its visit method",
    ("training_profiler.audit.source", "_CODE_INTERNAL"):
        "memo of a pure function: code object -> whether it is torch's or ours (a hot path)",
}

#: (writer module, module.name written) -> why it is still there: writes known and waiting for
#: their fix (none now: amp_checker.context read its tables into amp_checker.values at import
#: until the tables moved there); an entry whose write is gone fails.
PENDING_CROSS_WRITES: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                          ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        return name in MUTABLE_CALLS
    return False


def _module_aliases(tree: ast.Module, module: str, modules: set[str]) -> dict[str, str]:
    """Local name -> project module, for every import of one (relative ones resolved)."""
    package = module if any(m.startswith(module + ".") for m in modules) else \
        module.rpartition(".")[0]
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                        a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}" if base else a.name
                if full in modules:
                    aliases[a.asname or a.name] = full
    return aliases


def _resolve(node: ast.expr, aliases: dict[str, str], modules: set[str]) -> str | None:
    """The project module an expression names (``alias`` or ``alias.sub``), else None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, aliases, modules)
        if base is not None and f"{base}.{node.attr}" in modules:
            return f"{base}.{node.attr}"
    return None


def _written(target: ast.expr) -> ast.expr:
    """The container a write goes into: ``X[k] = `` / ``X.attr[k] = `` -> X (or X.attr)."""
    while isinstance(target, (ast.Subscript, ast.Starred)):
        target = target.value
    return target


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, (ast.Assign, ast.Delete)):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


class _ModuleScan(ast.NodeVisitor):
    """One pass over a module: its writes into names (with the function scopes they happen
    in) and its writes into other modules."""

    def __init__(self, module: str, aliases: dict[str, str], modules: set[str]) -> None:
        self.module, self.aliases, self.modules = module, aliases, modules
        self.scopes: list[set[str]] = []          # names bound in each enclosing function
        self.item_writes: list[tuple[str, int, list[set[str]]]] = []
        self.found: list[str] = []

    def _function(self, node: ast.AST) -> None:
        self.scopes.append(set())
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Global(self, node: ast.Global) -> None:
        self.found.append(f"{self.module}:{node.lineno}: global {', '.join(node.names)} (keep "
                          "it in an object: STATE, or the module's own state object)")

    def visit_Name(self, node: ast.Name) -> None:
        if self.scopes and isinstance(node.ctx, ast.Store):
            self.scopes[-1].add(node.id)

    def visit_arg(self, node: ast.arg) -> None:
        if self.scopes:
            self.scopes[-1].add(node.arg)

    def _write(self, base: ast.expr, line: int, item: bool) -> None:
        if isinstance(base, ast.Name) and item and self.scopes:
            self.item_writes.append((base.id, line, list(self.scopes)))
        elif isinstance(base, ast.Attribute):
            other = _resolve(base.value, self.aliases, self.modules)
            if other is not None and other != self.module:
                self.found.append(f"{self.module}:{line}: writes {other}.{base.attr}, another "
                                  "module's global (pass it an object or a callback instead)")

    def generic_visit(self, node: ast.AST) -> None:
        for t in _targets(node):
            self._write(_written(t), node.lineno,
                        isinstance(t, ast.Subscript) or isinstance(node, ast.AugAssign))
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
                self._write(func.value, node.lineno, True)
            other = _resolve(node.args[0], self.aliases, self.modules) if node.args else None
            if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and \
                    other not in (None, self.module):
                self.found.append(f"{self.module}:{node.lineno}: {func.id} on module {other}")
        super().generic_visit(node)

    def state_writes(self) -> dict[str, int]:
        """Module name -> first line a function writes into it (names no scope binds)."""
        out: dict[str, int] = {}
        for name, line, scopes in self.item_writes:
            if not any(name in scope for scope in scopes):
                out.setdefault(name, line)
        return out


def _mutable_tops(tree: ast.Module) -> dict[str, int]:
    """Module-level names bound to a mutable container -> their line."""
    tops: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and \
                _is_mutable(node.value):
            for t in _targets(node):
                if isinstance(t, ast.Name):
                    tops[t.id] = node.lineno
    return tops


def scan(sources: dict[str, str]) -> list[str]:
    """Every finding over modules ``{name: source}`` (one line each: module, line, what)."""
    trees = {m: ast.parse(src) for m, src in sources.items()}
    modules = set(trees)
    found: list[str] = []
    for m, tree in trees.items():
        visitor = _ModuleScan(m, _module_aliases(tree, m, modules), modules)
        visitor.visit(tree)
        found += visitor.found
        writes = visitor.state_writes()
        for name, line in sorted(_mutable_tops(tree).items()):
            if name in writes:
                found.append(f"{m}:{line}: {name} is module-level state (written at line "
                             f"{writes[name]}); keep it in STATE / the module's state object, "
                             "or list it in ALLOWED with its reason")
    return sorted(set(found))


def _sources() -> dict[str, str]:
    return {_module_name(p): p.read_text(encoding="utf-8")
            for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def test_no_hidden_module_state_in_the_library():
    found = scan(_sources())
    listed = {(m, f" {n} is module-level state") for m, n in ALLOWED}
    listed |= {(m, f" writes {w}, ") for m, w in PENDING_CROSS_WRITES}
    unexpected = [f for f in found if not any(f.startswith(f"{m}:") and what in f
                                              for m, what in listed)]
    assert not unexpected, "\n".join(unexpected)
    stale = [f"{m}: {what.strip()}" for m, what in listed
             if not any(f.startswith(f"{m}:") and what in f for f in found)]
    assert not stale, f"listed but no longer found (drop the entry): {stale}"


def test_the_scan_sees_each_kind_of_hidden_state():
    """Each pattern it must catch, in a small made-up package; constants and locals pass."""
    sources = {
        "pkg.a": textwrap.dedent("""
            TABLE = {"x": 1}                     # read only: a constant
            BUILT = {}
            for k in "ab":
                BUILT[k] = len(k)                # filled at import: still a constant
            _CACHE = {}
            _SEEN: list = []
            _FLAG = set()

            def get(k):
                items = []                       # a local list is no module state
                items.append(k)
                _CACHE[k] = TABLE.get(k)
                return _CACHE[k]

            def see(k, _FLAG=None):
                _SEEN.append(k)
                _FLAG.add(k)                     # a parameter, not the module's set

            def turn():
                global _COUNT
                _COUNT = 1
            """),
        "pkg.b": textwrap.dedent("""
            from . import a
            a._FLAG.add(1)                       # at import, into another module

            def late():
                a.TABLE = {}
                setattr(a, "BUILT", None)
            """),
        "pkg": "",
    }
    found = scan(sources)
    text = "\n".join(found)
    for expected in ("pkg.a:6: _CACHE is module-level state", "pkg.a:7: _SEEN is module-level",
                     "pkg.a:21: global _COUNT", "pkg.b:3: writes pkg.a._FLAG",
                     "pkg.b:6: writes pkg.a.TABLE", "pkg.b:7: setattr on module pkg.a"):
        assert expected in text, (expected, text)
    assert "TABLE is module-level" not in text and "BUILT is module-level" not in text
    assert "items" not in text and "_FLAG is module-level" not in text
