"""What a name holds, by following the code rather than reading its spelling.

The AMP rules need a few facts that real training code rarely states on the line where they
matter: that ``ctx`` in ``with ctx:`` is an autocast (``ctx = nullcontext() if cpu else
torch.autocast(...)``, ``amp = partial(torch.autocast, "cuda")``, ``self.autocast = ...``), that
``loss_scaler`` is a GradScaler wrapper rather than a loss, that ``criterion`` is an
``nn.CrossEntropyLoss``. ``Evaluator`` answers them with a small abstract interpretation:
flow-insensitive bindings per scope (assignments, ``with ... as``, parameters with their defaults
and, one call level up, the arguments of their callers), class attributes set through
``self.x = ...``, conditional and boolean expressions as unions, ``functools.partial`` and lambdas
as factories, and calls into functions and classes of the scanned project (``project``).
What comes from outside the project is ``EXTERNAL``: the rules say "unknown" instead of guessing.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from training_profiler.amp_checker.scopes import Bindings, ScopeBuilder, dotted

# Canonical autocast entry points -> (device when fixed by the name, positional argument names).
AUTOCAST_APIS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "torch.autocast": (None, ("device_type", "dtype", "enabled", "cache_enabled")),
    "torch.amp.autocast": (None, ("device_type", "dtype", "enabled", "cache_enabled")),
    "torch.amp.autocast_mode.autocast": (None, ("device_type", "dtype", "enabled", "cache_enabled")),
    "torch.cuda.amp.autocast": ("cuda", ("enabled", "dtype", "cache_enabled")),
    "torch.cuda.amp.autocast_mode.autocast": ("cuda", ("enabled", "dtype", "cache_enabled")),
    "torch.cpu.amp.autocast": ("cpu", ("enabled", "dtype", "cache_enabled")),
}
# Torch's dtype names, spelled as the code may spell them -> the dtype.
DTYPE_NAMES = {
    "torch.float16": "float16", "torch.half": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32", "torch.float": "float32",
}


class ModuleView(Protocol):
    """What the evaluator and the project read of one parsed module (``context.FileContext``
    provides it); named here so these modules do not import the context that builds on them."""

    tree: ast.Module
    nodes: list[ast.AST]
    module_name: str
    path: str
    parents: dict[ast.AST, ast.AST]
    aliases: dict[str, str]
    calls: list[ast.Call]
    project: Any  # project.Project

    @property
    def values(self) -> "Evaluator": ...
    def qualname(self, expr: ast.AST) -> str | None: ...
    def call_name(self, call: ast.Call) -> str | None: ...
    def autocast_call(self, expr: ast.AST) -> Any: ...
    def import_qualname(self, node: ast.Import | ast.ImportFrom, local: str) -> str | None: ...
    def scope_of(self, node: ast.AST, direct: bool = False) -> Any: ...


@dataclass(frozen=True, eq=False)
class Val:
    """One abstract value. ``kind`` is one of the module constants below; ``scope`` is set for
    autocast values, ``node``/``ctx`` for project functions, classes and instances, ``name`` for
    externals and torch objects."""

    kind: str
    scope: Any = None  # the context.AmpScope an autocast value opens
    node: ast.AST | None = None
    ctx: ModuleView | None = field(default=None, repr=False)
    name: str = ""

    def identity(self) -> tuple:
        """What this value is, for comparing answers (values are made afresh each time a
        question is asked, so they are not compared by object)."""
        return (self.kind, self.scope, id(self.node), id(self.ctx), self.name)


AUTOCAST = "autocast"                  # a context manager that turns autocast on (scope says how)
AUTOCAST_FACTORY = "autocast_factory"  # calling it gives an AUTOCAST (partial, lambda, def)
NULL_CONTEXT = "null_context"          # nullcontext() and friends: the non-AMP twin of AUTOCAST
SCALER = "scaler"                      # a GradScaler, or an object that wraps one
SCALER_FACTORY = "scaler_factory"      # a class or function whose result is a SCALER
LOSS_FN = "loss_fn"                    # a torch loss function or nn.*Loss module
LOSS = "loss"                          # the value a loss function returned
OPTIMIZER = "optimizer"                # a torch.optim optimizer
OPTIMIZER_CLASS = "optimizer_class"    # torch.optim.AdamW itself (``optimizer_class = ...``)
FUNCTION = "function"                  # a def of the project (node, ctx)
CLASS = "class"                        # a class of the project
INSTANCE = "instance"                  # an instance of a project class
EXTERNAL = "external"                  # decided outside the scanned tree (name says what)
PARAM = "param"                        # a parameter nobody in the project passes
DTYPE = "dtype"                        # a torch dtype (name: 'float16', 'bfloat16', 'float32')
STRING = "string"                      # a string literal (name: its text): "bf16-mixed", "fp16"

_NULL_CONTEXTS = {"contextlib.nullcontext", "contextlib.suppress", "contextlib.ExitStack",
                  "torch.no_grad", "torch.enable_grad"}
_SCALER_CLASSES = ("GradScaler", "ShardedGradScaler")
#: GradScaler wrappers that libraries ship (their objects scale the loss when called and keep a
#: GradScaler's state_dict): timm's, which DeiT, MAE, ConvNeXt and Swin train with.
_EXTERNAL_SCALER_CLASSES = frozenset({"timm.utils.NativeScaler", "timm.utils.cuda.NativeScaler"})


def is_scaler_class(qualname: str) -> bool:
    """torch's GradScaler classes and the library wrappers of :data:`_EXTERNAL_SCALER_CLASSES`."""
    return ((qualname.rsplit(".", 1)[-1] in _SCALER_CLASSES and qualname.startswith("torch."))
            or qualname in _EXTERNAL_SCALER_CLASSES)
_LOSS_CLASS_SUFFIX = "Loss"
_TORCH_LOSS_FUNCTIONS = {
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss",
    "gaussian_nll_loss", "cosine_embedding_loss", "margin_ranking_loss", "hinge_embedding_loss",
    "multi_margin_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss", "ctc_loss",
}
def is_torch_loss_function(qualname: str) -> bool:
    head, _, last = qualname.rpartition(".")
    return head in ("torch.nn.functional", "torch", "F") and last in _TORCH_LOSS_FUNCTIONS


def is_torch_loss_class(qualname: str) -> bool:
    return qualname.startswith(("torch.nn.", "nn.")) and qualname.endswith(_LOSS_CLASS_SUFFIX)


class Evaluator:
    """Abstract values of expressions in one module, reaching into the project for the rest."""

    def __init__(self, ctx: ModuleView) -> None:
        self.ctx = ctx
        sb = ScopeBuilder(ctx.tree)
        self.scopes = sb.of
        self.class_attrs = sb.class_attrs
        self._memo: dict[int, frozenset[Val]] = {}
        self._memo_facts: dict[tuple, Any] = {}  # other questions about this module's code, whole

    # ---- scopes ------------------------------------------------------------------------------
    def bindings_at(self, node: ast.AST) -> Bindings:
        cur: ast.AST | None = node
        while cur is not None:
            b = self.scopes.get(cur)
            if b is not None and cur is not node:
                return b
            if b is not None and isinstance(cur, ast.Module):
                return b
            cur = self.ctx.parents.get(cur)
        return self.scopes[self.ctx.tree]

    def enclosing_class(self, node: ast.AST) -> ast.ClassDef | None:
        cur = self.ctx.parents.get(node)
        while cur is not None and not isinstance(cur, ast.ClassDef):
            cur = self.ctx.parents.get(cur)
        return cur

    # ---- values ------------------------------------------------------------------------------
    def value(self, expr: ast.AST | None) -> frozenset[Val]:
        """The abstract values ``expr`` may hold (empty when nothing is known)."""
        if expr is None:
            return frozenset()
        key = id(expr)
        if key in self._memo:  # the common case, answered without a frame of its own
            return self._memo[key]
        return self.ctx.project.questions.answer(key, self._memo, lambda: frozenset(self._value(expr)),
                                 frozenset())

    def known(self, expr: ast.AST) -> frozenset[Val] | None:
        """The values of ``expr`` when they were computed whole before, else None."""
        return self._memo.get(id(expr))

    def _value(self, e: ast.AST) -> set[Val]:
        if isinstance(e, ast.IfExp):
            return set(self.value(e.body)) | set(self.value(e.orelse))
        if isinstance(e, ast.BoolOp):
            out: set[Val] = set()
            for v in e.values:
                out |= self.value(v)
            return out
        if isinstance(e, ast.NamedExpr):
            return set(self.value(e.value))
        if isinstance(e, ast.Lambda):
            return {f for v in self.value(e.body) if (f := self._as_factory(v)) is not None}
        if isinstance(e, ast.Call):
            return self._call_value(e)
        if isinstance(e, ast.Name):
            return self._name_value(e)
        if isinstance(e, ast.Attribute):
            return self._attr_value(e)
        if isinstance(e, ast.Await):
            return set(self.value(e.value))
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return {Val(STRING, name=e.value)}
        if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Dict):
            out = set()
            for v in e.value.values:
                out |= self.value(v)
            return out
        return set()

    @staticmethod
    def _as_factory(v: Val) -> Val | None:
        if v.kind == AUTOCAST:
            return Val(AUTOCAST_FACTORY, scope=v.scope)
        if v.kind == SCALER:
            return Val(SCALER_FACTORY)
        return None

    def _qual_value(self, q: str, node: ast.AST) -> set[Val]:
        """Values of a name that resolves to something outside this module."""
        ctx = self.ctx
        last = q.rsplit(".", 1)[-1]
        if q in DTYPE_NAMES:
            return {Val(DTYPE, name=DTYPE_NAMES[q])}
        if q.startswith("torch.optim.") and last[:1].isupper():
            return {Val(OPTIMIZER_CLASS, name=q)}
        if q in AUTOCAST_APIS:
            return {Val(AUTOCAST_FACTORY, name=q)}
        if is_scaler_class(q):
            return {Val(SCALER_FACTORY, name=q)}
        if is_torch_loss_function(q):
            return {Val(LOSS_FN, name=q)}
        if ctx.project is not None:
            found = ctx.project.resolve_qualname(q, ctx)
            if found is not None:
                return found
        return {Val(EXTERNAL, name=q)}

    def _name_value(self, e: ast.Name) -> set[Val]:
        hit = self.bindings_at(e).lookup(e.id)
        if hit is None:
            q = self.ctx.aliases.get(e.id)
            return self._qual_value(q, e) if q else set()
        return self._entries_value(hit[1], e.id, e)

    def _entries_value(self, entries: list[tuple[str, ast.AST]], name: str, at: ast.AST) -> set[Val]:
        out: set[Val] = set()
        for how, expr in entries:
            if how == "assign":
                out |= self.value(expr)
            elif how == "with_as":
                out |= {v for v in self.value(expr) if v.kind in (SCALER, LOSS_FN, OPTIMIZER)}
            elif how == "def":
                out.add(Val(FUNCTION, node=expr, ctx=self.ctx))
            elif how == "class":
                out.add(self._class_value(expr))
            elif how == "import":
                q = self.ctx.import_qualname(expr, name)
                if q:
                    out |= self._qual_value(q, at)
            elif how == "param":
                out |= self._param_value(expr, name)
            elif how == "unpack":
                out |= self._element_value(expr.value, expr.slice.value)
        return out

    def _element_value(self, source: ast.AST, index: int) -> set[Val]:
        """Element ``index`` of a tuple: written out (``a, b = x, y``), or returned as one by a
        project function (``weight_dtype, save_dtype = prepare_dtype(args)``)."""
        if isinstance(source, (ast.Tuple, ast.List)):
            return set(self.value(source.elts[index])) if index < len(source.elts) else set()
        if not isinstance(source, ast.Call):
            return set()
        out: set[Val] = set()
        for f in self.value(source.func):
            if f.kind == FUNCTION and f.ctx is not None:
                for n in f.ctx.values._exits(f.node):
                    if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple) and index < len(n.value.elts):
                        out |= f.ctx.values.value(n.value.elts[index])
        return out

    def module_attr(self, parts: list[str]) -> set[Val]:
        """Values of ``module.parts[0].parts[1]...`` seen from another module."""
        entries = self.scopes[self.ctx.tree].names.get(parts[0])
        if not entries:
            return set()
        vals = self._entries_value(entries, parts[0], self.ctx.tree)
        for attr in parts[1:]:
            nxt: set[Val] = set()
            for v in vals:
                if v.kind in (CLASS, SCALER_FACTORY, LOSS_FN) and isinstance(v.node, ast.ClassDef):
                    nxt |= self._class_attr(v.node, attr)
            vals = nxt
        return vals

    def _class_value(self, cls: ast.ClassDef) -> Val:
        if self.class_is_scaler(cls):
            return Val(SCALER_FACTORY, node=cls, ctx=self.ctx)
        for b in cls.bases:
            q = self.ctx.qualname(b) or ""
            if is_torch_loss_class(q):
                return Val(LOSS_FN, node=cls, ctx=self.ctx)
        return Val(CLASS, node=cls, ctx=self.ctx)

    def class_is_scaler(self, cls: ast.ClassDef) -> bool:
        """A class that holds a GradScaler (timm's NativeScaler, fairseq-style wrappers); asked
        each time the class is named, so answered once (whole) per class."""
        return self.ctx.project.questions.answer(("scaler_class", id(cls)), self._memo_facts,
                                 lambda: self._holds_scaler(cls), False)

    def _holds_scaler(self, cls: ast.ClassDef) -> bool:
        for values in self.class_attrs.get(cls, {}).values():
            for expr, _ in values:
                if any(v.kind == SCALER for v in self.value(expr)):
                    return True
        for b in cls.bases:
            if (self.ctx.qualname(b) or "").rsplit(".", 1)[-1] in _SCALER_CLASSES:
                return True
        return False

    def _param_value(self, fn: ast.AST, name: str) -> set[Val]:
        """A parameter: its default, and what the project's callers pass (one level)."""
        out: set[Val] = set()
        args = fn.args
        positional = [*args.posonlyargs, *args.args]
        defaults = dict(zip([a.arg for a in positional][len(positional) - len(args.defaults):], args.defaults))
        defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
        if name in defaults:
            out |= self.value(defaults[name])
        if self.ctx.project is not None and not isinstance(fn, ast.Lambda):
            index = [a.arg for a in positional].index(name) if name in [a.arg for a in positional] else None
            is_method = isinstance(self.ctx.parents.get(fn), ast.ClassDef)
            for call, cctx in self.ctx.project.calls_to(fn, self.ctx):
                arg = _argument(call, name, index, is_method)
                if arg is not None:
                    out |= cctx.values.value(arg)
        if all(v.kind == STRING for v in out):  # a default string says what it may hold, not who decides
            out.add(Val(PARAM, name=name))
        return out

    def _attr_value(self, e: ast.Attribute) -> set[Val]:
        ctx = self.ctx
        if isinstance(e.value, ast.Name) and e.value.id in ("self", "cls"):
            cls = self.enclosing_class(e)
            if cls is not None:
                return self._class_attr(cls, e.attr)
        q = ctx.qualname(e)
        head = (dotted(e) or "").split(".")[0]
        hit = self.bindings_at(e).lookup(head) if head else None
        imported = head in ctx.aliases and (hit is None or all(how == "import" for how, _ in hit[1]))
        if imported and q:
            return self._qual_value(q, e)
        out: set[Val] = set()
        for v in self.value(e.value):  # every class it may be an instance of, not the first a set yields
            if v.kind == INSTANCE and v.ctx is not None:
                out |= v.ctx.values._class_attr(v.node, e.attr)
        return out

    def _class_attr(self, cls: ast.ClassDef, attr: str) -> set[Val]:
        out: set[Val] = set()
        for expr, _ in self.class_attrs.get(cls, {}).get(attr, []):
            out |= self.value(expr)
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == attr:
                out.add(Val(FUNCTION, node=stmt, ctx=self.ctx))
        return out

    def _call_value(self, call: ast.Call) -> set[Val]:
        known = self._known_call_value(call)
        if known is not None:
            return known
        out: set[Val] = set()
        for f in self.value(call.func):
            out |= self._called(f, call)
        return out

    def _known_call_value(self, call: ast.Call) -> set[Val] | None:
        """What a call of a torch / functools API we know by name gives; None for any other."""
        ctx = self.ctx
        q = ctx.call_name(call) or ""
        if q in AUTOCAST_APIS:
            scope = ctx.autocast_call(call)
            return {Val(AUTOCAST, scope=scope)} if scope is not None else set()
        if q in _NULL_CONTEXTS or q.rsplit(".", 1)[-1] == "nullcontext":
            return {Val(NULL_CONTEXT)}
        if q in ("functools.partial", "partial") and call.args:
            inner = self.value(call.args[0])
            if any(v.kind == AUTOCAST_FACTORY for v in inner):
                scope = ctx.autocast_call(ast.Call(func=call.args[0], args=call.args[1:],
                                                   keywords=call.keywords))
                return {Val(AUTOCAST_FACTORY, scope=scope)}
            return {Val(SCALER_FACTORY)} if any(v.kind == SCALER_FACTORY for v in inner) else set()
        if q.startswith("torch.optim.") and q.rsplit(".", 1)[-1][:1].isupper():
            return {Val(OPTIMIZER, name=q)}
        if is_torch_loss_class(q):
            return {Val(LOSS_FN, name=q)}
        if is_torch_loss_function(q):
            return {Val(LOSS, name=q)}
        return None

    def _called(self, f: Val, call: ast.Call) -> set[Val]:
        """What calling a value of kind ``f.kind`` gives (a factory's product, a project
        function's returns, ...)."""
        if f.kind == AUTOCAST_FACTORY:
            scope = f.scope if f.scope is not None else self.ctx.autocast_call(call)  # None: the API itself
            return {Val(AUTOCAST, scope=scope)} if scope is not None else set()
        if f.kind == FUNCTION and f.ctx is not None:
            return f.ctx.values.returns(f.node)
        if f.kind == CLASS and f.ctx is not None:
            return {Val(INSTANCE, node=f.node, ctx=f.ctx)}
        made = _CALL_PRODUCTS.get(f.kind)
        if made is not None:
            return {Val(made, name=f.name)} if made in (LOSS, OPTIMIZER) else {Val(made)}
        if f.kind == EXTERNAL:
            return {Val(EXTERNAL, name=f.name + "()")}
        return set()

    def returns(self, fn: ast.FunctionDef) -> set[Val]:
        """What a project function returns: the union of its ``return`` values; a generator
        decorated with contextmanager that yields under autocast counts as an autocast."""
        out: set[Val] = set()
        decorated_cm = any((self.ctx.qualname(d) or "").endswith("contextmanager") for d in fn.decorator_list)
        for n in self._exits(fn):
            if isinstance(n, ast.Return) and n.value is not None:
                out |= self.value(n.value)
            elif decorated_cm and isinstance(n, (ast.Yield, ast.YieldFrom)):
                s = self.ctx.scope_of(n)
                if s is not None:
                    out.add(Val(AUTOCAST, scope=s))
        return out

    def _exits(self, fn: ast.AST) -> list[ast.AST]:
        """The ``return`` and ``yield`` nodes of ``fn``'s own body (found once per function)."""
        key = ("exits", id(fn))
        if key not in self._memo_facts:
            self._memo_facts[key] = [n for n in _own_nodes(fn) if isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom))]
        return self._memo_facts[key]

    # ---- questions the rules ask --------------------------------------------------------------
    def kinds(self, expr: ast.AST | None) -> set[str]:
        """The kinds of object ``expr`` may be; string literals it may hold are ``strings``."""
        return {v.kind for v in self.value(expr) if v.kind != STRING}

    def strings(self, expr: ast.AST | None) -> set[str]:
        """The string literals ``expr`` may hold (``precision = precision or default()``)."""
        return {v.name for v in self.value(expr) if v.kind == STRING}


def _own_nodes(fn: ast.AST) -> Iterable[ast.AST]:
    """Nodes of a function body, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(n))


def _argument(call: ast.Call, name: str, index: int | None, is_method: bool) -> ast.AST | None:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    if index is None:
        return None
    if is_method:
        index -= 1  # `self` is bound by the call
    if 0 <= index < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[:index + 1]):
        return call.args[index]
    return None


#: value kind -> the kind calling it makes (a scaler factory makes a scaler, a loss class a loss)
_CALL_PRODUCTS = {SCALER_FACTORY: SCALER, LOSS_FN: LOSS, OPTIMIZER_CLASS: OPTIMIZER}

