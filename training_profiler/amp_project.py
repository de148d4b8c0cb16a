"""Project mode: the scanned tree analysed as one program.

Real training code sets up precision in one module and uses it in another: the GradScaler lives in
``utils/amp.py``, the autocast context in a trainer base class, the loss in ``losses.py``. A
``Project`` holds one ``FileContext`` per module, resolves imports (absolute, relative, and the
"script folder on sys.path" style of training scripts) to modules of the tree, and finds the call
sites of a function one level up, so a rule in one module can use what another one sets up. A name
that leads outside the tree stays ``EXTERNAL``: the rules then say "unknown" instead of guessing.
"""
from __future__ import annotations

import ast
from pathlib import Path

from training_profiler.amp_values import EVALUATING, FUNCTION, Val
from training_profiler.amp_values import ModuleView as FileContext


def module_name(path: Path) -> str:
    """The dotted name Python would import ``path`` under: climb while the folder is a package
    (``pkg/sub/mod.py`` with ``__init__.py`` files -> ``pkg.sub.mod``); a package's
    ``__init__`` is the package itself; a script outside any package is its stem."""
    path = path.resolve()
    parts = [] if path.stem == "__init__" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts) or path.stem


class Project:
    """Modules of one scanned tree, by dotted name."""

    def __init__(self) -> None:
        self.modules: dict[str, FileContext] = {}
        self._by_last: dict[str, list[str]] = {}
        self._calls: dict[str, list[tuple[ast.Call, FileContext]]] | None = None
        self._resolving: set[tuple[str, str]] = set()
        self._importers: dict[str, set[str]] | None = None

    def add(self, ctx: FileContext) -> None:
        self.modules[ctx.module_name] = ctx
        self._by_last.setdefault(ctx.module_name.rsplit(".", 1)[-1], []).append(ctx.module_name)
        self._calls = None
        self._importers = None

    # ---- imports -------------------------------------------------------------------------
    def find_module(self, dotted: str, importer: FileContext) -> FileContext | None:
        """The project module an import names: exact, else the module whose name ends with it,
        nearest to the importer (scripts import siblings as top-level modules)."""
        if dotted in self.modules:
            return self.modules[dotted]
        last = dotted.rsplit(".", 1)[-1]
        # the scan may start below the import root (megatron/core scanned, megatron.core.x
        # imported) or above it (a repo scanned, its scripts import siblings by short name)
        cands = [m for m in self._by_last.get(last, [])
                 if m.endswith("." + dotted) or dotted.endswith("." + m)]
        if not cands:
            return None
        here = importer.module_name.rsplit(".", 1)[0] if "." in importer.module_name else ""
        cands.sort(key=lambda m: (not m.startswith(here + ".") if here else False, m.count(".")))
        return self.modules[cands[0]]

    def resolve_qualname(self, qual: str, importer: FileContext) -> set[Val] | None:
        """Values of ``pkg.mod.attr.sub`` when a prefix of it is a project module (re-export
        cycles between packages end in "nothing known")."""
        key = (qual, importer.module_name)
        if key in self._resolving or len(self._resolving) > 40:
            EVALUATING.cut_at(-1)  # what depends on this answer is partial: not remembered
            return set()
        self._resolving.add(key)
        try:
            return self._resolve(qual, importer)
        finally:
            self._resolving.discard(key)

    def _resolve(self, qual: str, importer: FileContext) -> set[Val] | None:
        parts = qual.split(".")
        for cut in range(len(parts), 0, -1):
            mod = self.find_module(".".join(parts[:cut]), importer)
            if mod is None or mod is importer and cut == len(parts):
                continue
            rest = parts[cut:]
            if not rest:
                return set()  # a module object: nothing the rules need
            return mod.values.module_attr(rest)
        return None

    def _imports_of(self, ctx: FileContext) -> set[str]:
        """Project modules ``ctx`` imports (anywhere in it, functions included)."""
        out: set[str] = set()
        for node in ast.walk(ctx.tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ctx.import_qualname(node, node.names[0].asname or node.names[0].name) or ""
                base = base.rsplit(".", 1)[0] if base else (node.module or "")
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                m = self.find_module(n, ctx) if n else None
                if m is not None and m is not ctx:
                    out.add(m.module_name)
        return out

    def users_of(self, ctx: FileContext) -> list[FileContext]:
        """``ctx``, every project module that imports it (directly or through others) and, for a
        module inside a package, the rest of its top-level package: the code that decides the
        precision a library module runs in (YOLOX's trainer gets its head through an experiment
        object, not an import). A folder of unrelated scripts is not one program, so its
        modules do not vouch for each other."""
        if self._importers is None:
            self._importers = {}
            for m in list(self.modules.values()):
                for dep in self._imports_of(m):
                    self._importers.setdefault(dep, set()).add(m.module_name)
        seen = {ctx.module_name}
        todo = [ctx.module_name]
        while todo:
            for user in self._importers.get(todo.pop(), ()):
                if user not in seen:
                    seen.add(user)
                    todo.append(user)
        if "." in ctx.module_name:  # a package is one program: its trainer decides for its heads
            top = ctx.module_name.split(".", 1)[0] + "."
            seen |= {n for n in self.modules if n.startswith(top)}
        return [self.modules[n] for n in sorted(seen) if n in self.modules]  # a set's order varies per run

    def is_one_program(self, scanned: list[FileContext]) -> bool:
        """The scanned files are a project, not loose scripts: one of them sits in a package or
        imports another scanned module."""
        names = {c.module_name for c in scanned}
        return any("." in n for n in names) or any(
            self._imports_of(c) & names for c in scanned)

    # ---- calls ---------------------------------------------------------------------------
    def _call_index(self) -> dict[str, list[tuple[ast.Call, FileContext]]]:
        if self._calls is None:
            self._calls = {}
            for ctx in self.modules.values():
                for n in ctx.calls:
                    f = n.func
                    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                    if name:
                        self._calls.setdefault(name, []).append((n, ctx))
        return self._calls

    def calls_to(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, owner: FileContext
                 ) -> list[tuple[ast.Call, FileContext]]:
        """Call sites in the project that resolve to ``fn`` (defined in ``owner``)."""
        out = []
        for call, ctx in self._call_index().get(fn.name, []):
            if any(v.kind == FUNCTION and v.node is fn for v in ctx.values.value(call.func)):
                out.append((call, ctx))
        return out
