"""What every static-check rule needs to know about one parsed file.

Rules ask three questions again and again: "what is this name really?" (import and alias
resolution), "is this node under autocast, and which one?" (scope tracking), and "does this file
use AMP / low precision at all?". Answering them once here keeps each rule's visitor small.
Names are followed to what they hold (``values``) and across the scanned tree
(``project``), so an autocast held in a variable or a GradScaler made in another module count.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from functools import cached_property

from quant.vocabulary import LOW_PRECISION_DTYPES
from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.project import Project
from training_profiler.amp_checker.values import AUTOCAST_APIS, DTYPE_NAMES, dotted

# Autocast's documented default dtype per device.
_DEFAULT_DTYPE = {"cuda": "float16", "cpu": "bfloat16"}
MIXED = "mixed"  # a library runs autocast in the precision (the model's parameters stay float32)
TRUE = "true"    # a library casts the model's parameters to the precision


@dataclass(frozen=True)
class LibraryAmpFlag:
    """A training library's switch for mixed precision: the call (by its last name), the
    keyword, and what each value of it selects (dtype, MIXED or TRUE)."""

    callees: tuple[str, ...]
    keyword: str
    values: dict[object, tuple[str, str]]


_HF_TRAINERS = ("TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig", "Trainer", "Seq2SeqTrainer")
_LIGHTNING = ("Fabric", "Trainer")
LIBRARY_AMP_FLAGS: tuple[LibraryAmpFlag, ...] = (
    LibraryAmpFlag(_HF_TRAINERS, "fp16", {True: ("float16", MIXED)}),
    LibraryAmpFlag(_HF_TRAINERS, "bf16", {True: ("bfloat16", MIXED)}),
    LibraryAmpFlag(("Accelerator",), "mixed_precision", {"fp16": ("float16", MIXED), "bf16": ("bfloat16", MIXED)}),
    LibraryAmpFlag(_LIGHTNING, "precision", {
        16: ("float16", MIXED), "16": ("float16", MIXED), "16-mixed": ("float16", MIXED),
        "bf16": ("bfloat16", MIXED), "bf16-mixed": ("bfloat16", MIXED),
        "16-true": ("float16", TRUE), "bf16-true": ("bfloat16", TRUE)}),
)


@dataclass(frozen=True)
class AmpScope:
    """One autocast region: device ('cuda', 'cpu' or 'unknown'), dtype and whether it is on."""

    device: str
    dtype: str
    enabled: bool
    node: ast.AST
    conditional: bool = False   # `autocast(...) if amp else nullcontext()`: the AMP path of two
    inherited: bool = False     # not opened here: every call of this function is under it


def _one_scope(scopes: list[AmpScope]) -> AmpScope:
    """The autocast a value that may hold several opens (a context manager yielding under float16
    autocast on one branch and bfloat16 on another, composer's precision context): the enabled
    ones, their device and dtype when they agree, else 'unknown' (chosen at run time). Whatever
    order the values come in, the same answer."""
    on = [s for s in scopes if s.enabled] or scopes
    first = min(on, key=lambda s: (s.device, s.dtype, getattr(s.node, "lineno", 0), getattr(s.node, "col_offset", 0)))
    device = first.device if all(s.device == first.device for s in on) else "unknown"
    dtype = first.dtype if all(s.dtype == first.dtype for s in on) else "unknown"
    return replace(first, device=device, dtype=dtype)  # the caller says whether it is conditional


class FileContext:
    """Aliases, parents and autocast scopes of one module's AST."""

    def __init__(self, tree: ast.Module, project: Project | None = None,
                 module_name: str = "<string>", path: str = "<string>") -> None:
        self.tree = tree
        self.module_name = module_name
        self.path = path
        self.aliases: dict[str, str] = {}
        self.parents: dict[ast.AST, ast.AST] = {}
        self.calls: list[ast.Call] = []
        self._scope: dict[ast.AST, AmpScope | None] = {}
        self._scopes_state = 0  # 0 not computed, 1 computing, 2 done
        self._autocast_scopes: list[AmpScope] = []
        self.facts: dict[object, object] = {}  # module-wide facts the rules ask once (intent.per_module)
        self.nodes: list[ast.AST] = list(ast.walk(tree))  # every node, in ast.walk's order: walked once
        self._collect_aliases()
        for node in self.nodes:
            if isinstance(node, ast.Call):
                self.calls.append(node)
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.project = project if project is not None else Project()
        self.project.add(self)

    @cached_property
    def values(self) -> "av.Evaluator":
        return av.Evaluator(self)

    @property
    def autocast_scopes(self) -> list[AmpScope]:
        self._ensure_scopes()
        return self._autocast_scopes

    @cached_property
    def has_gradscaler(self) -> bool:
        """A GradScaler is made, imported or used here (by what it is or how it is used)."""
        return bool(self.scaler_calls) or any(
            (q := self.qualname(n)) is not None and (q.split(".")[-1] in ("GradScaler", "ShardedGradScaler")
                                                     or av.is_scaler_class(q))
            for n in self.nodes if isinstance(n, (ast.Name, ast.Attribute))
        ) or any(
            isinstance(n, ast.ImportFrom) and any(a.name.endswith("GradScaler") for a in n.names)
            for n in self.nodes
        )

    @cached_property
    def scaler_calls(self) -> list[ast.Call]:
        """Calls that apply loss scaling: ``s.scale(loss)`` on a GradScaler (by value, or by use:
        the same receiver also gets ``.update()`` / ``.unscale_()`` / ``.step(opt)``) and calls of
        a scaler wrapper object (``loss_scaler(loss, optimizer)``)."""
        used: dict[str, set[str]] = {}
        for c in self.calls:
            if isinstance(c.func, ast.Attribute):
                r = dotted(c.func.value)
                if r:
                    used.setdefault(r, set()).add(c.func.attr)
        out = []
        for c in self.calls:
            f = c.func
            if isinstance(f, ast.Attribute) and f.attr == "scale":
                r = dotted(f.value) or ""
                if av.SCALER in self.values.kinds(f.value) or used.get(r, set()) & {"update", "unscale_"}:
                    out.append(c)
            elif av.SCALER in self.values.kinds(f):
                out.append(c)
        return out

    @cached_property
    def manual_lowp_casts(self) -> list[ast.Call]:
        return [n for n in self.calls if self.lowp_cast_dtype(n)]

    @cached_property
    def lowp_functions(self) -> set[str]:
        """Functions that return autocast results (a `return` under autocast): their calls
        produce low-precision tensors wherever they are called."""
        return {
            fn.name for fn in self.nodes if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any(isinstance(r, ast.Return) and r.value is not None and self.in_autocast(r, direct=True)
                    for r in ast.walk(fn))
        }

    @property
    def uses_amp(self) -> bool:
        """Autocast to a low precision (a float32 autocast only upcasts) or loss scaling here."""
        return any(s.dtype != "float32" for s in self.autocast_scopes) or self.has_gradscaler

    @cached_property
    def library_precisions(self) -> set[tuple[str, str]]:
        """(dtype, MIXED or TRUE) that a training library is told to use here: one of
        ``LIBRARY_AMP_FLAGS`` given a literal value (or a name, a conditional or a project
        function holding one: ``precision = precision or default_precision()``), or apex's
        ``amp.initialize`` (float16 AMP). A value chosen at run time between a mixed and a true
        precision (``"bf16-mixed" if training else "bf16-true"``, the branches not followed)
        counts as mixed only: half parameters are claimed only when every value the code can
        pass is a ``-true`` one."""
        out: set[tuple[str, str]] = set()
        for c in self.calls:
            name = self.call_name(c) or ""
            if name.startswith("apex.amp."):
                out.add(("float16", MIXED))
            last = name.rsplit(".", 1)[-1] or (c.func.attr if isinstance(c.func, ast.Attribute) else "")
            for flag in LIBRARY_AMP_FLAGS:
                value = next((k.value for k in c.keywords if k.arg == flag.keyword), None)
                if value is None and last in flag.callees:
                    value = self._unpacked_keyword(c, flag.keyword)
                if last in flag.callees and value is not None:
                    told = {flag.values[v] for v in self._literals(value) if v in flag.values}
                    if any(how == MIXED for _, how in told):
                        told = {t for t in told if t[1] == MIXED}
                    out |= told
        return out

    def _unpacked_keyword(self, call: ast.Call, keyword: str) -> ast.AST | None:
        """The value ``call`` gets for ``keyword`` through ``**kwargs`` that its function fills
        (``fabric_kwargs.update(precision="16-mixed")``, ``kwargs["precision"] = ...``,
        ``kwargs = dict(precision=...)``) before the call."""
        names = {k.value.id for k in call.keywords if k.arg is None and isinstance(k.value, ast.Name)}
        if not names:
            return None
        for node in ast.walk(self.enclosing_function(call)):
            if getattr(node, "lineno", call.lineno) > call.lineno:
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in names:
                found = next((k.value for k in node.keywords if k.arg == keyword), None)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                t = node.targets[0]
                found = None
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in names \
                        and isinstance(t.slice, ast.Constant) and t.slice.value == keyword:
                    found = node.value
                elif isinstance(t, ast.Name) and t.id in names and isinstance(node.value, ast.Call) \
                        and isinstance(node.value.func, ast.Name) and node.value.func.id == "dict":
                    found = next((k.value for k in node.value.keywords if k.arg == keyword), None)
            else:
                continue
            if found is not None:
                return found
        return None

    def _literals(self, expr: ast.AST) -> set[object]:
        """Literal values ``expr`` may hold: a constant, or the strings its value follows to."""
        if isinstance(expr, ast.Constant):
            return {expr.value}
        return set(self.values.strings(expr))

    @property
    def library_amp(self) -> bool:
        """A training library runs this code's model under autocast (see library_precisions)."""
        return any(how == MIXED for _, how in self.library_precisions)

    @property
    def project_uses_amp(self) -> bool:
        """This module, or a module of the scanned project that imports it (directly or through
        others), trains with AMP: model code whose precision its training script decides.
        Asked once per call by some rules, so kept (rules run after every module is parsed)."""
        if "_project_uses_amp" not in self.facts:
            self.facts["_project_uses_amp"] = any(m.uses_amp or m.library_amp for m in self.project.users_of(self))
        return self.facts["_project_uses_amp"]

    @property
    def uses_lowp(self) -> bool:
        return self.uses_amp or bool(self.manual_lowp_casts)

    # ---- names -------------------------------------------------------------------------
    def _collect_aliases(self) -> None:
        for node in self.nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        head = a.name.split(".")[0]
                        self.aliases[head] = head
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name != "*":
                        q = self.import_qualname(node, a.asname or a.name)
                        if q:
                            self.aliases[a.asname or a.name] = q
        # Module-level `F = torch.nn.functional` style aliases.
        for node in self.tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)):
                q = self.qualname(node.value)
                if q and q.startswith("torch."):
                    self.aliases[node.targets[0].id] = q

    def import_qualname(self, node: ast.Import | ast.ImportFrom, local: str) -> str | None:
        """The dotted name ``local`` stands for after this import; relative imports are made
        absolute from this module's own name."""
        for a in node.names:
            if (a.asname or (a.name if isinstance(node, ast.ImportFrom) else a.name.split(".")[0])) != local:
                continue
            if isinstance(node, ast.Import):
                return a.name if a.asname else a.name.split(".")[0]
            base = node.module or ""
            if node.level:
                pkg = self.module_name.split(".")
                is_package = self.path.endswith("__init__.py")
                keep = len(pkg) - node.level + (1 if is_package else 0)
                prefix = ".".join(pkg[:max(keep, 0)])
                base = ".".join(x for x in (prefix, base) if x)
            return f"{base}.{a.name}" if base else a.name
        return None

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

    def literal_dtype(self, expr: ast.AST | None) -> str | None:
        """'float16' / 'bfloat16' / 'float32' when ``expr`` names a torch dtype itself
        (``torch.half``), not a variable that may hold one; else None."""
        return DTYPE_NAMES.get(self.qualname(expr)) if isinstance(expr, (ast.Name, ast.Attribute)) else None

    def dtype_of(self, expr: ast.AST | None) -> str | None:
        """'float16' / 'bfloat16' / 'float32' for a dtype expression, 'unknown' otherwise."""
        if expr is None:
            return None
        q = self.qualname(expr)
        if q in DTYPE_NAMES:
            return DTYPE_NAMES[q]
        choices = self.dtype_choices(expr)
        if len(choices) == 1:
            return next(iter(choices))
        for lowp in LOW_PRECISION_DTYPES:  # a run-time choice: the low-precision path is the one to judge
            if lowp in choices:
                return lowp
        return "unknown"

    def dtype_choices(self, expr: ast.AST) -> set[str]:
        """The dtypes a variable or parameter may hold (``weight_dtype = torch.float16 if
        fp16 else torch.float32``; a ``torch_dtype`` parameter its callers pass)."""
        if isinstance(expr, (ast.Name, ast.Attribute, ast.IfExp, ast.Subscript)):
            return {v.name for v in self.values.value(expr) if v.kind == av.DTYPE}
        return set()

    # ---- autocast scopes ---------------------------------------------------------------
    def autocast_call(self, expr: ast.AST) -> AmpScope | None:
        """The scope an autocast(...) call opens, or None if ``expr`` is not one."""
        if not isinstance(expr, ast.Call):
            return None
        api = AUTOCAST_APIS.get(self.call_name(expr) or "")
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

    def with_scope(self, expr: ast.AST) -> AmpScope | None:
        """The autocast a ``with`` item or decorator opens: the API called in place, or a value
        that holds one (variable, attribute, partial, factory call, conditional with a
        nullcontext twin). A method named ``autocast`` of a library object (Accelerate,
        Lightning Fabric) opens autocast with a device and dtype decided outside the tree."""
        s = self.autocast_call(expr)
        if s is not None:
            return s
        vals = self.values.value(expr)
        scopes = [v.scope for v in vals if v.kind == av.AUTOCAST and v.scope is not None]
        if scopes:
            conditional = any(v.kind == av.NULL_CONTEXT for v in vals) or len(vals) > len(scopes)
            return replace(_one_scope(scopes), node=expr, conditional=conditional)
        f = expr.func if isinstance(expr, ast.Call) else expr
        if isinstance(f, ast.Attribute) and f.attr == "autocast" and all(v.kind == av.EXTERNAL for v in vals):
            return AmpScope("unknown", "unknown", True, expr)
        return None

    def _ensure_scopes(self) -> None:
        if self._scopes_state == 0:
            self._scopes_state = 1
            self._annotate(self.tree, None)
            self._scopes_state = 2

    def _annotate(self, node: ast.AST, scope: AmpScope | None) -> None:
        self._scope[node] = scope
        if isinstance(node, (ast.With, ast.AsyncWith)):
            inner = scope
            for item in node.items:
                self._annotate(item, scope)
                s = self.with_scope(item.context_expr)
                if s is not None:
                    self._autocast_scopes.append(s)
                    inner = s
            for stmt in node.body:
                self._annotate(stmt, inner)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner = None  # a function body runs where it is called, not where it is defined
            for dec in getattr(node, "decorator_list", []):
                self._annotate(dec, scope)
                s = self.with_scope(dec)
                if s is not None:
                    self._autocast_scopes.append(s)
                    inner = s
            self._annotate(node.args, scope)
            body = node.body if isinstance(node.body, list) else [node.body]
            for stmt in body:
                self._annotate(stmt, inner)
            return
        for child in ast.iter_child_nodes(node):
            self._annotate(child, scope)

    def scope_of(self, node: ast.AST, direct: bool = False) -> AmpScope | None:
        """The autocast ``node`` runs under: opened in this file, or (unless ``direct``)
        inherited from the callers of its function when every project call site is under one."""
        self._ensure_scopes()
        s = self._scope.get(node)
        if s is not None or direct:
            return s
        fn = self.enclosing_function(node)
        return self.caller_scope(fn) if fn is not self.tree else None

    def caller_scope(self, fn: ast.AST) -> AmpScope | None:
        """One call level up: the scope shared by every call site of ``fn`` in the project."""
        cache = self.facts.setdefault("_caller_scopes", {})
        if fn in cache:
            return cache[fn]
        cache[fn] = None  # recursion guard
        sites = self.project.calls_to(fn, self)
        scopes = [c.scope_of(call, direct=True) for call, c in sites]
        out = None
        if scopes and all(x is not None and x.enabled for x in scopes):
            out = replace(scopes[0], inherited=True)
        cache[fn] = out
        return out

    def in_autocast(self, node: ast.AST, direct: bool = False) -> bool:
        s = self.scope_of(node, direct)
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
                if d in LOW_PRECISION_DTYPES:
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

    def parents_chain(self, node: ast.AST):
        """The ancestors of ``node``, innermost first."""
        cur = self.parents.get(node)
        while cur is not None:
            yield cur
            cur = self.parents.get(cur)

    def enclosing_function(self, node: ast.AST) -> ast.AST:
        cur = self.parents.get(node)
        while cur is not None and not isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cur = self.parents.get(cur)
        return cur if cur is not None else self.tree
