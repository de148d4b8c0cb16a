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
from typing import Iterable, Sequence

from training_profiler.amp_checker.questions import Questions
from training_profiler.amp_checker.values import FUNCTION, Val
from training_profiler.amp_checker.values import ModuleView as FileContext


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


def module_names(paths: Iterable[Path]) -> dict[Path, str]:
    """``module_name`` of each file, made unique: scripts that share a name in different folders
    (a repository's ``examples/a/train.py`` and ``examples/b/train.py``) are separate programs,
    so each is named by as many of its folders as tell them apart (``a.train``, ``b.train``);
    under one name, one would replace the other in the project and its own calls would be
    looked up in the other file."""
    named = {p: module_name(p) for p in paths}
    by_name: dict[str, list[Path]] = {}
    for p, name in named.items():
        by_name.setdefault(name, []).append(p)
    for name, same in by_name.items():
        if len(same) < 2:
            continue
        # the folders above each file's import root (a package module's own folders are in its name)
        folders = [p.resolve().parts[:-1 - name.count(".")] for p in same]
        depth = 1
        while depth <= max(len(f) for f in folders) and len({f[-depth:] for f in folders}) < len(same):
            depth += 1
        for p, f in zip(same, folders):
            named[p] = ".".join([*f[-depth:], name])
    return named


PROGRAM_MARKERS = ("setup.py", "pyproject.toml", "setup.cfg", ".git")


def program_root(path: Path, scan_roots: Sequence[Path] = ()) -> Path | None:
    """The folder of the program ``path`` belongs to, so that two repositories scanned side by
    side never vouch for each other: the outermost folder holding a project marker (setup.py,
    pyproject.toml, setup.cfg, .git) at or below the scan root the file was found under; else
    the nearest such folder above it (a scan of a repository's sub-folders); else None (no
    marker anywhere: the scan is one program, as before)."""
    path = path.resolve()
    folders = list(path.parents)
    root = next((r for r in sorted((r.resolve() for r in scan_roots), key=lambda r: -len(r.parts))
                 if r == path or r in folders), None)
    below = [f for f in folders if root is not None and (f == root or root in f.parents)]
    marked = [f for f in below if _marked(f)]
    if marked:
        return marked[-1]  # parents run upward: the last is the outermost
    return next((f for f in folders if f not in below and _marked(f)), None)


def _marked(folder: Path) -> bool:
    return any((folder / m).exists() for m in PROGRAM_MARKERS)


class Project:
    """Modules of one scanned tree, by dotted name. A scan may hold several programs (two
    repositories side by side): each module's program (``program_key``) bounds what vouches
    for it, what its imports resolve to and the evidence the rules gather for it."""

    def __init__(self, scan_roots: Sequence[str | Path] = ()) -> None:
        self.modules: dict[str, FileContext] = {}
        self.scan_roots = tuple(Path(r) for r in scan_roots)
        self.questions = Questions()  # the fixpoint of this scan's questions (questions)
        self.facts: dict[object, object] = {}  # project-wide facts the rules ask once (per program)
        self._programs: dict[str, Path | None] = {}
        self._by_last: dict[str, list[str]] = {}
        self._calls: dict[str, _CallSites] | None = None
        self._qualnames: dict[tuple[str, str, str], frozenset[Val] | None] = {}
        self._importers: dict[str, set[str]] | None = None
        self._calls_to: dict[tuple[str, int], tuple[tuple[ast.Call, FileContext], ...]] = {}

    def add(self, ctx: FileContext) -> None:
        self.modules[ctx.module_name] = ctx
        self._programs[ctx.module_name] = (program_root(Path(ctx.path), self.scan_roots)
                                           if Path(ctx.path).is_file() else None)
        self._by_last.setdefault(ctx.module_name.rsplit(".", 1)[-1], []).append(ctx.module_name)
        self._calls = None
        self._importers = None
        self._calls_to.clear()
        self._qualnames.clear()

    # ---- programs ------------------------------------------------------------------------
    def program_key(self, ctx: FileContext) -> Path | None:
        """The root folder of ``ctx``'s program (``program_root``); None: the scan's one program."""
        return self._programs.get(ctx.module_name)

    def program_modules(self, ctx: FileContext) -> list[FileContext]:
        """Every module of ``ctx``'s program: the modules a project-wide fact (a float16 cast,
        a GradScaler, training) is gathered from for ``ctx``, never another program's."""
        key = self._programs.get(ctx.module_name)
        return [m for n, m in self.modules.items() if self._programs.get(n) == key]

    def _same_program(self, a: str, b: str) -> bool:
        return self._programs.get(a) == self._programs.get(b)

    # ---- imports -------------------------------------------------------------------------
    def find_module(self, dotted: str, importer: FileContext) -> FileContext | None:
        """The project module an import names: exact, else the module whose name ends with it,
        nearest to the importer (scripts import siblings as top-level modules)."""
        if dotted in self.modules and self._same_program(dotted, importer.module_name):
            return self.modules[dotted]
        last = dotted.rsplit(".", 1)[-1]
        # the scan may start below the import root (megatron/core scanned, megatron.core.x
        # imported) or above it (a repo scanned, its scripts import siblings by short name);
        # only inside the importer's own program
        cands = [m for m in self._by_last.get(last, [])
                 if (m.endswith("." + dotted) or dotted.endswith("." + m))
                 and self._same_program(m, importer.module_name)]
        if not cands:
            return None
        here = importer.module_name.rsplit(".", 1)[0] if "." in importer.module_name else ""
        beside = Path(importer.path).parent
        cands.sort(key=lambda m: (Path(self.modules[m].path).parent != beside,
                                  not m.startswith(here + ".") if here else False, m.count(".")))
        return self.modules[cands[0]]

    def resolve_qualname(self, qual: str, importer: FileContext) -> frozenset[Val] | None:
        """Values of ``pkg.mod.attr.sub`` when a prefix of it is a project module (None when
        none is); a re-export cycle between packages is a cycle of questions (values)."""
        def compute() -> frozenset[Val] | None:
            found = self._resolve(qual, importer)
            return None if found is None else frozenset(found)
        return self.questions.answer(("qualname", qual, importer.module_name), self._qualnames, compute,
                                 frozenset())

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
        for node in ctx.nodes:
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
        importers = self._importer_index()
        seen = {ctx.module_name}
        todo = [ctx.module_name]
        while todo:
            for user in importers.get(todo.pop(), ()):
                if user not in seen:
                    seen.add(user)
                    todo.append(user)
        if "." in ctx.module_name:  # a package is one program: its trainer decides for its heads
            top = ctx.module_name.split(".", 1)[0] + "."
            seen |= {n for n in self.modules if n.startswith(top) and self._same_program(n, ctx.module_name)}
        return [self.modules[n] for n in sorted(seen) if n in self.modules]  # a set's order varies per run

    def _importer_index(self) -> dict[str, set[str]]:
        """Module name -> the project modules that import it, built once."""
        if self._importers is None:
            self._importers = {}
            for m in list(self.modules.values()):
                for dep in self._imports_of(m):
                    self._importers.setdefault(dep, set()).add(m.module_name)
        return self._importers

    def neighbours_of(self, ctx: FileContext) -> list[FileContext]:
        """``ctx``, the project modules it imports and those that import it, one step each way:
        the code that hands it its model or takes its outputs, not every module of its package."""
        names = {ctx.module_name} | self._imports_of(ctx) | self._importer_index().get(ctx.module_name, set())
        return [self.modules[n] for n in sorted(names) if n in self.modules]

    def program_of(self, ctx: FileContext) -> list[FileContext]:
        """The program ``ctx`` belongs to: its users (``users_of``) and the project modules
        they import; a folder of separate scripts is not one program."""
        users = self.users_of(ctx)
        names = {m.module_name for m in users} | {d for m in users for d in self._imports_of(m)}
        return [self.modules[n] for n in sorted(names) if n in self.modules]

    def imports_and_importers(self, ctx: FileContext) -> tuple[list[FileContext], list[FileContext]]:
        """The project modules ``ctx`` imports, and those that import it (one step each way):
        whether a script hands its model to training code, or training code runs the script's."""
        imported = sorted(self._imports_of(ctx))
        importers = sorted(self._importer_index().get(ctx.module_name, set()))
        return ([self.modules[n] for n in imported if n in self.modules],
                [self.modules[n] for n in importers if n in self.modules])

    def is_one_program(self, scanned: list[FileContext]) -> bool:
        """The scanned files are a project, not loose scripts: one of them sits in a package or
        imports another scanned module."""
        names = {c.module_name for c in scanned}
        return any("." in n for n in names) or any(
            self._imports_of(c) & names for c in scanned)

    # ---- calls ---------------------------------------------------------------------------
    def _call_index(self) -> dict[str, _CallSites]:
        if self._calls is None:
            self._calls = {}
            for ctx in self.modules.values():
                for n in ctx.calls:
                    f = n.func
                    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                    if name:
                        self._calls.setdefault(name, _CallSites()).candidates.append((n, ctx))
        return self._calls

    def calls_to(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, owner: FileContext
                 ) -> list[tuple[ast.Call, FileContext]]:
        """Call sites in the project that resolve to ``fn`` (defined in ``owner``); asked again
        for the same function by many rules and parameters, so remembered once whole."""
        sites = self._call_index().get(fn.name)
        if sites is None:
            return []
        key = ("calls_to", id(fn))
        if key in self.questions.on_stack:  # asked again while finding them: the values' own cuts decide
            return list(sites.resolving_to(fn))
        return list(self.questions.answer(key, self._calls_to, lambda: sites.resolving_to(fn), ()))


class _CallSites:
    """The calls of one name across the project (``x.step(...)``, ``step(...)``), filed by the
    functions they resolve to once that is known whole, so that asking for the call sites of
    each of a thousand ``__init__`` or ``forward`` methods does not evaluate every call of that
    name again. A call whose callee is not known whole yet (it was asked inside a cycle) stays
    open and is evaluated again when asked."""

    def __init__(self) -> None:
        self.candidates: list[tuple[ast.Call, FileContext]] = []
        self._filed: dict[ast.AST, list[int]] = {}
        self._open: set[int] | None = None

    def resolving_to(self, fn: ast.AST) -> tuple[tuple[ast.Call, FileContext], ...]:
        if self._open is None:
            self._open = set(range(len(self.candidates)))
        hits: set[int] = set()
        for i in sorted(self._open):
            if i not in self._open:  # filed meanwhile, by a question asked while evaluating
                continue
            call, ctx = self.candidates[i]
            values = ctx.values.value(call.func)
            if any(v.kind == FUNCTION and v.node is fn for v in values):
                hits.add(i)
            if i in self._open and ctx.values.known(call.func) is not None:
                self._open.discard(i)
                for v in values:
                    if v.kind == FUNCTION:
                        self._filed.setdefault(v.node, []).append(i)
        hits.update(self._filed.get(fn, ()))
        return tuple(self.candidates[i] for i in sorted(hits))
