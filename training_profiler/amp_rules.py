"""The static AMP checker's rules: one Rule object (id, severity, texts) and one visitor each.

The rules follow PyTorch's automatic-mixed-precision documentation: which ops autocast runs in
float32 and which in low precision, what autocast refuses (binary_cross_entropy on CUDA), the
GradScaler workflow (unscale before clipping), and the deprecated ``torch.cuda.amp`` names.
Each visitor only reports; filtering (suppression comments, rule selection) happens in
``static_checker``.
"""
from __future__ import annotations

import ast
import functools
import itertools
import re
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from training_profiler import amp_values as av
from training_profiler.amp_context import FileContext, dotted
from training_profiler.amp_intent import (TRAINING, cast_purpose, float32_result, is_float32_cast, no_grad_region,
                                          on_non_amp_branch, receiver_root, training_backward_calls)

_FP16 = np.finfo(np.float16)
FP16_MAX = float(_FP16.max)
FP16_MIN_SUBNORMAL = float(_FP16.smallest_subnormal)
FP16_MIN_NORMAL = float(_FP16.smallest_normal)


class _Level(IntEnum):
    """A three-level scale read from a command line (low / medium / high)."""

    @classmethod
    def parse(cls, text: str):
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"unknown {cls.__name__.lower()} {text!r}; "
                             "use low, medium or high") from None


class Severity(_Level):
    LOW = 1
    MEDIUM = 2
    HIGH = 3


class Confidence(_Level):
    """How sure the checker is that a finding's pattern is live in mixed-precision training:
    HIGH, the training (autocast, a scaler, a low-precision model that an optimizer steps) is
    seen; MEDIUM, the precision is decided outside the scan (a library, a launcher's config);
    LOW, no training is seen at all: the seed's pattern only, reported in case it runs under AMP."""
    LOW = 1
    MEDIUM = 2
    HIGH = 3


NO_TRAINING_NOTE = " (no training seen; if this runs under AMP, {why})"


@dataclass(frozen=True)
class Finding:
    rule_id: str
    severity: Severity
    path: str
    line: int
    col: int
    message: str
    explanation: str
    suggestion: str
    confidence: Confidence = Confidence.HIGH

    def to_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "col": self.col, "rule": self.rule_id,
                "severity": self.severity.name, "confidence": self.confidence.name.lower(),
                "message": self.message, "explanation": self.explanation, "suggestion": self.suggestion}


class RuleVisitor(ast.NodeVisitor):
    """Base visitor: walks the tree and collects (node, message) pairs for its rule."""

    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx
        self.hits: list[tuple[ast.AST, str, Confidence]] = []

    def report(self, node: ast.AST, message: str, confidence: Confidence | None = None) -> None:
        """A hit; its confidence defaults to HIGH, or MEDIUM when the message says the
        precision is decided outside the scan ("unknown")."""
        if confidence is None:
            confidence = Confidence.MEDIUM if message.endswith("unknown)") else Confidence.HIGH
        self.hits.append((node, message, confidence))

    def run(self) -> list[tuple[ast.AST, str, Confidence]]:
        self.visit(self.ctx.tree)
        return self.hits


_LOSS_NAME = re.compile(r"(loss|crit|cross_entropy|nll|mse|bce|kl_div|huber)", re.I)
_NOT_A_LOSS = {av.SCALER, av.SCALER_FACTORY, av.OPTIMIZER, av.AUTOCAST, av.AUTOCAST_FACTORY,
               av.CLASS, av.FUNCTION, av.NULL_CONTEXT}


def _is_loss_call(ctx: FileContext, call: ast.Call) -> bool:
    """A call that computes a loss: a torch loss function, an ``nn.*Loss`` module (however it
    reached this name), or a project function that returns one. Only a callee nothing is known
    of (a parameter, a library object) falls back to its name, and then not when it is given
    an optimizer or a GradScaler (``loss_scaler(loss, optimizer)`` applies a loss, it does not
    compute one)."""
    if any(v.kind == av.LOSS for v in ctx.values.value(call)):
        return True
    if ctx.values.kinds(call.func) & _NOT_A_LOSS:
        return False
    name = (ctx.call_name(call) or "").split(".")[-1]
    if not _LOSS_NAME.search(name) or "scal" in name.lower():
        return False
    args = [*call.args, *(k.value for k in call.keywords)]
    return not any(ctx.values.kinds(a) & {av.OPTIMIZER, av.SCALER} for a in args)


def _per_module(fn):
    """Cache a module-wide fact on the module's context: the rules ask it once per node."""
    key = "_fact_" + fn.__name__

    @functools.wraps(fn)
    def cached(ctx: FileContext):
        if key not in ctx.__dict__:
            ctx.__dict__[key] = fn(ctx)
        return ctx.__dict__[key]
    return cached


def trains(ctx: FileContext) -> bool:
    """The module runs a training step (a backward that updates parameters, or loss scaling);
    an inference pipeline or an export script does not, so its casts are not training casts."""
    return bool(training_backward_calls(ctx) or ctx.scaler_calls)


@_per_module
def training_lowp_casts(ctx: FileContext) -> list[ast.Call]:
    """Manual low-precision casts whose purpose is training (not a checkpoint copy, an
    evaluation model, a round trip or a frozen module) in a module that trains, off any
    non-AMP branch."""
    return [c for c in ctx.manual_lowp_casts if trains(ctx)
            and cast_purpose(ctx, c) == TRAINING and not on_non_amp_branch(ctx, c)]


def _has_kw(call: ast.Call, name: str) -> bool:
    return any(k.arg == name for k in call.keywords)


# --------------------------------------------------------------------------------------------
class ManualCast(RuleVisitor):
    """Training casts in AMP code, and float16 casts on a path that selected bfloat16 (wherever
    they are: float16 cannot hold what the bfloat16 path was chosen for)."""

    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        d = ctx.lowp_cast_dtype(node)
        if d:
            attr = node.func.attr  # type: ignore[attr-defined]
            what = f".{attr}()" if attr in ("half", "bfloat16") else f".{attr}({d})"
            bf16_if = next((a for a in ctx.parents_chain(node) if isinstance(a, ast.If)
                            and _selects_bf16(ctx, a.test) and _in_body(a, node)), None)
            literal = attr == "half" or any(ctx.qualname(a) in ("torch.float16", "torch.half") for a in
                                            [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")])
            if d == "float16" and literal and bf16_if is not None:
                self.report(node, f"{what} on the bfloat16 path (`{ast.unparse(bf16_if.test)[:60]}`)")
            elif ctx.uses_amp and node in training_lowp_casts(ctx):
                note = _runtime_dtype_note(ctx, node)
                if not note or _module_like(ctx, node):
                    self.report(node, f"{what} call detected{note}")
        self.generic_visit(node)


_MODULE_METHODS = {"parameters", "named_parameters", "eval", "train", "requires_grad_", "state_dict",
                   "load_state_dict", "modules", "children", "set_progress_bar_config", "register_buffer"}


def _module_like(ctx: FileContext, call: ast.Call) -> bool:
    """The cast's receiver is used as a module (its parameters, train/eval, state_dict...) in
    the same function: a run-time dtype cast of a batch or an activation to match a frozen
    model (``batch["pixel_values"].to(dtype=weight_dtype)``) is data plumbing, not a cast of
    trained weights."""
    name = dotted(receiver_root(call))
    if not name:
        return False
    fn = ctx.enclosing_function(call)
    if not any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in _MODULE_METHODS
               and dotted(c.func.value) == name for c in ast.walk(fn)):
        return False
    trained = _optimized_modules(ctx, fn)
    return trained is None or name.split(".")[0] in trained


def _optimized_modules(ctx: FileContext, fn: ast.AST) -> set[str] | None:
    """Names whose parameters reach an optimizer built in ``fn`` (through the call's arguments
    and the variables they name, one assignment back); None when ``fn`` builds none. A module
    cast to ``weight_dtype`` next to an optimizer that does not hold it is not being trained
    (diffusers' T2I-adapter script trains the adapter, not the UNet)."""
    built = [c for c in ast.walk(fn) if isinstance(c, ast.Call)
             and any(v.kind == av.OPTIMIZER for v in ctx.values.value(c))]
    if not built:
        return None
    exprs: list[ast.AST] = [a for c in built for a in [*c.args, *(k.value for k in c.keywords)]]
    assigned = {t.id: st.value for st in ast.walk(fn) if isinstance(st, ast.Assign)
                for t in st.targets if isinstance(t, ast.Name)}
    out: set[str] = set()
    for _ in range(2):
        more = []
        for e in exprs:
            for n in ast.walk(e):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in (
                        "parameters", "named_parameters") and dotted(n.func.value):
                    out.add(dotted(n.func.value).split(".")[0])  # type: ignore[union-attr]
                elif isinstance(n, ast.Name) and n.id in assigned:
                    more.append(assigned.pop(n.id))
        exprs = more
    return out


def _in_body(branch: ast.If, node: ast.AST) -> bool:
    return any(node is n for stmt in branch.body for n in ast.walk(stmt))


def _runtime_dtype_note(ctx: FileContext, call: ast.Call) -> str:
    """' (dtype chosen at run time: ...)' when the cast's dtype is a variable or parameter."""
    for a in [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")]:
        if (ctx.qualname(a) or "torch.").startswith("torch."):
            continue  # a literal dtype, or not a name at all
        choices = ctx.dtype_choices(a)
        if len(choices) > 1:
            return f" (dtype chosen at run time: one of {', '.join(sorted(choices))})"
    return ""


_BCE = {"torch.nn.functional.binary_cross_entropy", "torch.binary_cross_entropy",
        "torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss"}


class BceUnderAutocast(RuleVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        if (ctx.uses_amp or ctx.apex_amp or ctx.project_uses_amp) and not ctx.cpu_only_autocast \
                and ctx.call_name(node) in _BCE:
            scope = ctx.scope_of(node)
            if scope is None or scope.enabled:
                name = ctx.call_name(node).split(".")[-1]  # type: ignore[union-attr]
                self.report(node, f"{name} usage in AMP code")
        self.generic_visit(node)


def _produced_names(ctx: FileContext, stmt: ast.AST) -> set[str]:
    """Names an autocast block leaves holding low-precision results: assigned from calls or
    arithmetic inside it, except losses (autocast computes those in float32)."""
    out: set[str] = set()
    for n in ast.walk(stmt):
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and isinstance(
                getattr(n, "value", None), (ast.Call, ast.BinOp)):
            if isinstance(n.value, ast.Call) and (_is_loss_call(ctx, n.value) or float32_result(ctx, n.value)):
                continue
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for x in ast.walk(t):
                    if isinstance(x, ast.Name):
                        out.add(x.id)
    return out


def _lowp_names_in(ctx: FileContext, expr: ast.AST, names: set[str]) -> set[str]:
    """Which of ``names`` reach ``expr`` without passing through a float32 cast first
    (``logits.float()`` hands the loss a float32 tensor)."""
    if is_float32_cast(ctx, expr):
        return set()
    if isinstance(expr, ast.Name):
        return {expr.id} & names
    out: set[str] = set()
    for child in ast.iter_child_nodes(expr):
        out |= _lowp_names_in(ctx, child, names)
    return out


def _statement_lists(tree: ast.AST):
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                yield stmts


class LossOutsideAutocast(RuleVisitor):
    def run(self):
        ctx = self.ctx
        for stmts in _statement_lists(ctx.tree):
            produced: set[str] = set()
            for stmt in stmts:
                if isinstance(stmt, (ast.With, ast.AsyncWith)) and any(
                        (s := ctx.with_scope(i.context_expr)) is not None and s.enabled
                        for i in stmt.items):
                    produced |= _produced_names(ctx, stmt)
                    continue
                if not produced:
                    continue
                for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                    if ctx.in_autocast(call) or not self._judged(call) or not _is_loss_call(ctx, call):
                        continue
                    used: set[str] = set()
                    for a in [*call.args, *(k.value for k in call.keywords)]:
                        used |= _lowp_names_in(ctx, a, produced)
                    if used:
                        self._say(call, (ctx.call_name(call) or "loss").split(".")[-1])
        self._prepared_model_losses()
        return self.hits

    def _judged(self, call: ast.Call) -> bool:
        """Under no_grad the loss is a metric, not a training signal (see EvalLossOutsideAutocast)."""
        return not no_grad_region(self.ctx, call)

    def _say(self, call: ast.Call, name: str) -> None:
        self.report(call, f"loss `{name}(...)` computed outside the autocast block")

    def _prepared_model_losses(self) -> None:
        """Accelerate in mixed precision runs a prepared model's forward under autocast (and
        DeepSpeed keeps its weights in float16): a torch loss on its raw output, not cast to
        float32, runs in low precision."""
        ctx = self.ctx
        if not any((ctx.call_name(c) or "").startswith("accelerate") for c in ctx.calls):
            return
        for fn in [ctx.tree, *(n for n in ast.walk(ctx.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
            prepared: set[str] = set()
            produced: set[str] = set()
            body = sorted((n for n in _own_statements(fn)), key=lambda n: (n.lineno, n.col_offset))
            for st in body:
                if isinstance(st, ast.Assign) and isinstance(st.value, ast.Call):
                    f = st.value.func
                    if isinstance(f, ast.Attribute) and f.attr == "prepare" and _is_accelerator(ctx, f.value):
                        prepared |= {n.id for t in st.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                        continue
                has_loss = False
                for call in (n for n in ast.walk(st) if isinstance(n, ast.Call)):
                    q = ctx.call_name(call) or ""
                    if not (av.is_torch_loss_function(q) or any(v.kind == av.LOSS for v in ctx.values.value(call))):
                        continue
                    has_loss = True
                    if not produced or ctx.in_autocast(call) or no_grad_region(ctx, call):
                        continue
                    used: set[str] = set()
                    for a in [*call.args, *(k.value for k in call.keywords)]:
                        used |= _lowp_names_in(ctx, a, produced)
                    if used:
                        self.report(call, f"loss `{q.rsplit('.', 1)[-1]}(...)` on the raw output of a model "
                                          f"Accelerate prepares in mixed precision (`{sorted(used)[0]}` not cast "
                                          "to float32: float16 under DeepSpeed, set by `accelerate config` "
                                          "outside the code: unknown)")
                if isinstance(st, ast.Assign) and not has_loss:  # a loss's value is computed in float32 by it
                    called = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in prepared
                                 for c in ast.walk(st.value))
                    if called or _lowp_names_in(ctx, st.value, produced):
                        produced |= {n.id for t in st.targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _own_statements(fn: ast.AST):
    """Simple statements of a function (or module) body, not of nested functions or classes."""
    stack = list(fn.body) if hasattr(fn, "body") else []
    while stack:
        st = stack.pop()
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)):
            yield st
        for field in ("body", "orelse", "finalbody", "handlers"):
            stack.extend(getattr(st, field, []) or [])


def _mixed_precision_accelerator(ctx: FileContext, call: ast.AST) -> bool:
    """``accelerate.Accelerator(mixed_precision=...)`` with a value other than the literal "no"
    (``mixed_precision=args.mixed_precision`` is a run-time choice: it may be fp16)."""
    q = (ctx.call_name(call) or "") if isinstance(call, ast.Call) else ""
    if not (q.startswith("accelerate") and q.endswith("Accelerator")):
        return False
    mp = next((k.value for k in call.keywords if k.arg == "mixed_precision"), None)  # type: ignore[attr-defined]
    return mp is not None and not (isinstance(mp, ast.Constant) and mp.value in ("no", None))


def _accelerate_autocast(ctx: FileContext) -> bool:
    """An Accelerator in mixed precision is built here: the models it prepares run under its
    autocast."""
    return any(_mixed_precision_accelerator(ctx, c) for c in ctx.calls)


def _is_accelerator(ctx: FileContext, expr: ast.AST) -> bool:
    """``expr`` names an Accelerator built here in mixed precision."""
    hit = ctx.values.bindings_at(expr).lookup(expr.id) if isinstance(expr, ast.Name) else None
    return any(how == "assign" and _mixed_precision_accelerator(ctx, value) for how, value in (hit[1] if hit else []))


_SOFTMAX = {"torch.softmax", "torch.log_softmax", "torch.nn.functional.softmax",
            "torch.nn.functional.log_softmax", "torch.special.softmax", "torch.special.log_softmax"}


class _LowpNames(RuleVisitor):
    """Visits in source order, tracking names that hold low-precision tensors: results of calls
    made inside an enabled autocast (except losses, which autocast runs in float32) and results
    of manual casts."""

    def __init__(self, ctx: FileContext) -> None:
        super().__init__(ctx)
        self.lowp: set[str] = set()

    def _update(self, targets: list[ast.AST], value: ast.AST | None, node: ast.AST) -> None:
        if isinstance(value, ast.Call) and float32_result(self.ctx, value):
            lowp = False  # softmax(..., dtype=torch.float32), x.float(): float32 from here on
        elif isinstance(value, ast.Call):
            lowp = self.ctx.lowp_cast_dtype(value) is not None or (
                self.ctx.in_autocast(node) and not _is_loss_call(self.ctx, value)) or (
                (self.ctx.call_name(value) or "").split(".")[-1] in self.ctx.lowp_functions)
        else:  # a matmul or other arithmetic computed under autocast
            lowp = isinstance(value, ast.BinOp) and self.ctx.in_autocast(node)
        for t in targets:
            if isinstance(t, ast.Name):
                (self.lowp.add if lowp else self.lowp.discard)(t.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        self._update(node.targets, node.value, node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self._update([node.target], node.value, node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        saved, self.lowp = self.lowp, set()
        self.generic_visit(node)
        self.lowp = saved

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def operand(self, call: ast.Call) -> ast.AST | None:
        if isinstance(call.func, ast.Attribute) and not (self.ctx.qualname(call.func) or "").startswith("torch."):
            return call.func.value
        return call.args[0] if call.args else None


class SoftmaxNoDtype(_LowpNames):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = ctx.call_name(node) or ""
        is_method = isinstance(node.func, ast.Attribute) and node.func.attr in ("softmax", "log_softmax") \
            and not name.startswith("torch.")
        if (name in _SOFTMAX or is_method) and not _has_kw(node, "dtype"):
            scope = ctx.scope_of(node)
            op = node.func.attr if isinstance(node.func, ast.Attribute) else name.split(".")[-1]
            if scope is not None and scope.enabled and scope.device == "cpu":
                self.report(node, f"{op} without dtype under CPU autocast (not promoted to float32)")
            elif scope is None or not scope.enabled:
                x = self.operand(node)
                if (isinstance(x, ast.Name) and x.id in self.lowp) or (
                        not ctx.autocast_scopes and not _accelerate_autocast(ctx) and any(
                            ctx.lowp_cast_dtype(c) == "float16" for c in training_lowp_casts(ctx))):
                    self.report(node, f"{op} without dtype on a low-precision tensor")
        self.generic_visit(node)


class ReductionOutsideAutocast(_LowpNames):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = ctx.call_name(node) or ""
        is_method = isinstance(node.func, ast.Attribute) and node.func.attr in ("sum", "mean") \
            and not name.startswith("torch.")
        if (is_method or name in ("torch.sum", "torch.mean")) and not ctx.in_autocast(node) \
                and not _has_kw(node, "dtype"):
            x = self.operand(node)
            if isinstance(x, ast.Name) and x.id in self.lowp:
                op = node.func.attr if isinstance(node.func, ast.Attribute) else name
                self.report(node, f"{op}() on low-precision tensor `{x.id}` outside autocast")
        self.generic_visit(node)


_DTYPE_SENSITIVE = {"mm", "bmm", "matmul", "einsum", "linear", "conv1d", "conv2d", "conv3d",
                    "addmm", "baddbmm", "addbmm", "conv_transpose2d", "scaled_dot_product_attention"}


def _dtype_sensitive(ctx: FileContext, fn: ast.AST) -> str | None:
    """'kernel' when the body calls compiled code (a module imported from outside torch, or
    ``torch.ops``: such kernels read every operand as one scalar type), 'matmul' for a matmul or
    convolution, None for a pass-through or an elementwise rescale."""
    found = None
    for n in ast.walk(fn):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
            found = found or "matmul"
        if isinstance(n, ast.Call):
            if _call_is_kernel(ctx, n):
                return "kernel"
            q = ctx.call_name(n) or ""
            if q.startswith("torch.") and q.rsplit(".", 1)[-1] in _DTYPE_SENSITIVE:
                found = found or "matmul"
    return found


def _is_extension_module(ctx: FileContext, name: str) -> bool:
    """A compiled extension: a module imported from outside torch/numpy/the standard helpers,
    or a module-level name bound to a loader call (``ext_loader.load_ext(...)``,
    ``torch.utils.cpp_extension.load(...)``, ``importlib.import_module(...)``)."""
    if name in ctx.aliases:
        return not ctx.aliases[name].startswith(("torch", "math", "numpy", "typing", "functools",
                                                 "warnings", "logging"))
    for how, expr in ctx.values.scopes[ctx.tree].names.get(name, []):
        if how == "assign" and isinstance(expr, ast.Call):
            callee = (ctx.call_name(expr) or "").rsplit(".", 1)[-1]
            if "load" in callee or callee == "import_module":
                return True
    return False


_NOT_FLOAT_OPERAND = ("mask", "index", "indices", "idx", "scale", "stride", "padding", "size", "shape")


def _float_operands_to_kernel(ctx: FileContext, forward: ast.FunctionDef) -> int:
    """How many of forward's tensor inputs reach a compiled kernel call: two float operands can
    come in different dtypes under autocast, one cannot mix with anything. Masks, indices and
    sizes (by their conventional names) are not float operands."""
    params = {a.arg for a in forward.args.args[1:]}
    params = {p for p in params if not any(w in p.lower() for w in _NOT_FLOAT_OPERAND)}
    used: set[str] = set()
    for n in ast.walk(forward):
        if isinstance(n, ast.Call) and _call_is_kernel(ctx, n):
            for a in [*n.args, *(k.value for k in n.keywords)]:
                root = a
                while isinstance(root, ast.Call) and isinstance(root.func, ast.Attribute):
                    root = root.func.value  # x.contiguous(), x.float()
                if isinstance(root, ast.Name) and root.id in params:
                    used.add(root.id)
    return len(used)


def _call_is_kernel(ctx: FileContext, n: ast.Call) -> bool:
    """A call into compiled code: ``torch.ops.*``, or a method of an extension module given
    tensors (names, attributes, call results) and not resolved to anything in the project."""
    if (ctx.call_name(n) or "").startswith("torch.ops."):
        return True
    head = (dotted(n.func) or "").split(".")[0]
    return (isinstance(n.func, ast.Attribute) and _is_extension_module(ctx, head)
            and any(isinstance(a, (ast.Name, ast.Attribute, ast.Call)) for a in n.args)
            and not (ctx.values.kinds(n.func) - {av.EXTERNAL}))


def _is_autograd_function(ctx: FileContext, cls: ast.ClassDef) -> bool:
    return any((ctx.qualname(b) or "") in ("torch.autograd.Function", "torch.autograd.function.Function")
               for b in cls.bases)


class AutogradFunctionNoCustomFwd(RuleVisitor):
    """A custom Function whose result depends on its operands agreeing in dtype, without
    custom_fwd/custom_bwd: in AMP code (this module or the project), or, for compiled kernels,
    in library code whose callers decide whether it runs under autocast (then the finding says
    so rather than guessing)."""

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        ctx = self.ctx
        if _is_autograd_function(ctx, node):
            amp_here = ctx.uses_lowp or ctx.project_uses_amp
            forward = next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "forward"), None)
            mixes = forward is not None and (_float_operands_to_kernel(ctx, forward) >= 2
                                             or _dtype_sensitive(ctx, forward) == "matmul")
            for item in node.body:
                if not (isinstance(item, ast.FunctionDef) and item.name in ("forward", "backward")):
                    continue
                kind = _dtype_sensitive(ctx, item)
                if kind == "kernel" and not mixes:
                    kind = None  # a single float operand (plus masks/indices): nothing can mix
                if kind is None or (not amp_here and kind != "kernel"):
                    continue
                want = "custom_fwd" if item.name == "forward" else "custom_bwd"
                decs = [(ctx.qualname(d.func if isinstance(d, ast.Call) else d) or "")
                        for d in item.decorator_list]
                if not any(d.split(".")[-1] == want for d in decs):
                    note = "" if amp_here else " (autocast is decided by its callers, outside the scan: unknown)"
                    self.report(item, f"autograd.Function {node.name}.{item.name} without @{want}{note}")
        self.generic_visit(node)


_DEPRECATED = {
    "torch.cuda.amp.autocast": 'torch.amp.autocast("cuda", ...)',
    "torch.cuda.amp.GradScaler": 'torch.amp.GradScaler("cuda", ...)',
    "torch.cuda.amp.custom_fwd": 'torch.amp.custom_fwd(device_type="cuda")',
    "torch.cuda.amp.custom_bwd": 'torch.amp.custom_bwd(device_type="cuda")',
    "torch.cpu.amp.autocast": 'torch.amp.autocast("cpu", ...)',
    "torch.cpu.amp.GradScaler": 'torch.amp.GradScaler("cpu", ...)',
}


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


class Fp16WithoutGradScaler(RuleVisitor):
    """Float16 training with a backward that no loss scaling reaches. Scaling is recognised by
    use (``s.scale(loss)`` with ``s.update()``), by value (a GradScaler, a class holding one)
    and across the project; when the loss goes to a callable from outside the tree together
    with an optimizer, the scaling is unknown and nothing is said."""

    def run(self):
        ctx = self.ctx
        backward = training_backward_calls(ctx)
        if ctx.has_gradscaler or not backward or _unknown_loss_handler(ctx):
            return self.hits
        evidence: list[tuple[ast.AST, str]] = [(s.node, "float16 autocast") for s in ctx.fp16_autocast
                                                if not on_non_amp_branch(ctx, s.node)]
        evidence += [(c, "manual float16 cast") for c in training_lowp_casts(ctx)
                     if ctx.lowp_cast_dtype(c) == "float16"]
        if evidence:
            node, what = min(evidence, key=lambda e: (e[0].lineno, e[0].col_offset))
            self.report(node, f"float16 training ({what}) without a GradScaler")
        return self.hits


def _unknown_loss_handler(ctx: FileContext) -> bool:
    """``handler(loss, optimizer)`` where handler comes from outside the tree (Apex amp,
    DeepSpeed, a framework's loss scaler): it may scale the loss; we cannot tell."""
    for c in ctx.calls:
        kinds = ctx.values.kinds(c.func)
        if kinds and kinds <= {av.EXTERNAL, av.PARAM}:
            args = [*c.args, *(k.value for k in c.keywords)]
            if len(args) >= 2 and any(ctx.values.kinds(a) & {av.OPTIMIZER} or
                                      (isinstance(a, ast.Name) and "optim" in a.id) for a in args):
                return True
        if isinstance(c.func, ast.Attribute) and c.func.attr in ("scale_loss", "backward") and (
                ctx.values.kinds(c.func.value) & {av.EXTERNAL, av.PARAM}) and c.args:
            return True  # apex amp.scale_loss(...), accelerator.backward(loss), engine.backward(loss)
    return False


class BackwardInAutocast(RuleVisitor):
    def run(self):
        for call in training_backward_calls(self.ctx):
            if self.ctx.in_autocast(call):
                self.report(call, "backward() called inside the autocast block")
        return self.hits


_CLIP = {"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_",
         "torch.nn.utils.clip_grad.clip_grad_norm_", "torch.nn.utils.clip_grad_norm",
         "clip_grad_norm_", "clip_grad_value_"}


def _is_torch_clip(ctx: FileContext, call: ast.Call) -> bool:
    q = ctx.call_name(call) or ""
    return q in _CLIP or (q.startswith("torch.") and q.split(".")[-1] in ("clip_grad_norm_", "clip_grad_value_"))


def _calls_helper_that(ctx: FileContext, call: ast.Call, pred) -> bool:
    """``call`` goes to a project function whose own body has a call satisfying ``pred``."""
    for v in ctx.values.value(call.func):
        if v.kind == av.FUNCTION and v.ctx is not None:
            if any(isinstance(n, ast.Call) and pred(v.ctx, n) for n in ast.walk(v.node)):
                return True
    return False


def _is_unscale(ctx: FileContext, call: ast.Call) -> bool:
    return isinstance(call.func, ast.Attribute) and call.func.attr == "unscale_"


def _scaler_steps(ctx: FileContext, fn: ast.AST) -> list[ast.Call]:
    """``s.step(opt)`` on a GradScaler: by value (followed through the project's callers) or by
    use (the same receiver gets ``.update()`` in this function)."""
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    updated = {dotted(c.func.value) for c in calls if c.func.attr == "update" and not c.args}  # type: ignore[attr-defined]
    return [c for c in calls if c.func.attr == "step" and c.args  # type: ignore[attr-defined]
            and (dotted(c.func.value) in updated or av.SCALER in ctx.values.kinds(c.func.value))]  # type: ignore[attr-defined]


def _clips_unscaled(ctx: FileContext, call: ast.Call) -> bool:
    """A torch clip with no ``unscale_`` before it in its own function (a helper that unscales
    and then clips, as SpeechBrain's ``optimizers_step`` does, is fine). A helper that steps the
    GradScaler itself owns the unscale: GradsChangedBeforeUnscale judges it in its own body, so
    its call site is not reported a second time."""
    if not _is_torch_clip(ctx, call):
        return False
    fn = ctx.enclosing_function(call)
    if _scaler_steps(ctx, fn):
        return False
    return not any(isinstance(n, ast.Call) and _is_unscale(ctx, n) and n.lineno < call.lineno
                   for n in ast.walk(fn))


class ClipWithoutUnscale(RuleVisitor):
    """Per function that scales a loss: a torch gradient clip (or a project helper that does
    one), on the AMP path, with no ``unscale_`` (or helper doing it) before it. Clipping through
    a library object (``accelerator.clip_grad_norm_``) unscales by itself or is unknown."""

    def run(self):
        ctx = self.ctx
        scaling = {id(c) for c in ctx.scaler_calls}
        if not scaling:
            return self.hits
        by_fn: dict[ast.AST, list[ast.Call]] = {}
        for n in ctx.calls:
            by_fn.setdefault(ctx.enclosing_function(n), []).append(n)
        for calls in by_fn.values():
            if not any(id(c) in scaling for c in calls):
                continue
            unscale_at = [c.lineno for c in calls if _is_unscale(ctx, c)
                          or _calls_helper_that(ctx, c, _is_unscale)]
            for c in calls:
                direct = _is_torch_clip(ctx, c)
                if not (direct or _calls_helper_that(ctx, c, _clips_unscaled)):
                    continue
                if any(line < c.lineno for line in unscale_at) or on_non_amp_branch(ctx, c):
                    continue
                what = (ctx.call_name(c) or "clip").split(".")[-1]
                via = "" if direct else " (it clips gradients)"
                self.report(c, f"{what}{via} on scaled gradients (no scaler.unscale_ before it)")
        return self.hits


def _receiver(call: ast.Call) -> str:
    return (dotted(call.func.value) or "") if isinstance(call.func, ast.Attribute) else ""


def _scaler_method_calls(ctx: FileContext, fn: ast.AST, attr: str) -> list[ast.Call]:
    scaling = {_receiver(c) for c in ctx.scaler_calls if isinstance(c.func, ast.Attribute)}
    return [c for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == attr and (_receiver(c) in scaling
                                         or av.SCALER in ctx.values.kinds(c.func.value))]


class UnscaleEveryMicroStep(RuleVisitor):
    """``scaler.unscale_`` that runs on every call while ``scaler.step`` sits under a condition
    (gradient accumulation): the unscale happens on micro-steps that do not step, so the next
    one raises or adds scaled gradients onto unscaled ones."""

    def run(self):
        ctx = self.ctx
        fns = {ctx.enclosing_function(c) for c in ctx.scaler_calls}
        for fn in fns:
            steps = _scaler_method_calls(ctx, fn, "step")
            for u in _scaler_method_calls(ctx, fn, "unscale_"):
                u_ifs = {id(a) for a in _ancestors_within(ctx, u, fn) if isinstance(a, ast.If)}
                for st in steps:
                    if _receiver(st) != _receiver(u) or st.lineno < u.lineno:
                        continue
                    guards = [a for a in _ancestors_within(ctx, st, fn)
                              if isinstance(a, ast.If) and id(a) not in u_ifs]
                    if guards:
                        self.report(u, f"{_receiver(u)}.unscale_ runs on every call, "
                                       f"{_receiver(st)}.step only when `{ast.unparse(guards[-1].test)}`")
                        break
        return self.hits


def _ancestors_within(ctx: FileContext, node: ast.AST, stop: ast.AST):
    return itertools.takewhile(lambda a: a is not stop, ctx.parents_chain(node))


class AutocastWrappedForward(RuleVisitor):
    """``model.forward = autocast(...)(model.forward)``: the outputs leave autocast in its low
    precision, so a loss written outside the model runs in float16/bfloat16."""

    def visit_Assign(self, node: ast.Assign) -> None:
        v = node.value
        if (isinstance(v, ast.Call) and v.args and isinstance(v.func, ast.Call)
                and any(isinstance(t, ast.Attribute) and t.attr == "forward" for t in node.targets)
                and any(x.kind == av.AUTOCAST for x in self.ctx.values.value(v.func))):
            self.report(v, "forward wrapped in autocast hands low-precision outputs to the caller")
        self.generic_visit(node)


_BF16_WORDS = ("bf16", "bfloat16")


def _selects_bf16(ctx: FileContext, test: ast.AST) -> bool:
    """An ``if`` test that holds when bfloat16 was chosen (``mode == "bf16"``, ``dtype is
    torch.bfloat16``, ``dtype in (torch.float16, torch.bfloat16)``), judged per comparison: the
    one naming bfloat16 must not be negated (``!=``, ``not in``, ``not ...``)."""
    def names_bf16(n: ast.AST) -> bool:
        return any((isinstance(x, ast.Constant) and isinstance(x.value, str) and x.value.lower() in _BF16_WORDS)
                   or (isinstance(x, (ast.Attribute, ast.Name)) and ctx.qualname(x) == "torch.bfloat16")
                   for x in ast.walk(n))

    def positive(n: ast.AST) -> bool:
        if isinstance(n, ast.BoolOp):
            return any(positive(v) for v in n.values)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            return False
        if isinstance(n, ast.Compare):
            return names_bf16(n) and not any(isinstance(o, (ast.NotEq, ast.IsNot, ast.NotIn)) for o in n.ops)
        return isinstance(n, (ast.Attribute, ast.Name)) and ctx.qualname(n) == "torch.bfloat16"

    return positive(test)


class GradScalerWithBf16(RuleVisitor):
    """A GradScaler made on the bfloat16 path (under an ``if`` that selects bfloat16, or, with no
    ``enabled=`` switch, in a module whose every autocast is bfloat16): bfloat16 has float32's
    exponent range, so loss scaling only adds inf checks and skipped steps."""

    def run(self):
        ctx = self.ctx
        scopes = [x for x in ctx.autocast_scopes if x.enabled]
        self._all_bf16 = bool(scopes) and all(x.dtype == "bfloat16" for x in scopes)
        return super().run()

    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        q0 = ctx.call_name(node) or ""
        if self._all_bf16 and q0.startswith("torch.") and q0.rsplit(".", 1)[-1] == "GradScaler" \
                and not _has_kw(node, "enabled"):
            self.report(node, "GradScaler with every autocast of this module in bfloat16")
            self.generic_visit(node)
            return
        q = ctx.call_name(node) or ""
        if q.startswith("torch.") and q.rsplit(".", 1)[-1] in ("GradScaler", "ShardedGradScaler") or (
                av.SCALER_FACTORY in ctx.values.kinds(node.func) and q.rsplit(".", 1)[-1].endswith("GradScaler")):
            child: ast.AST = node
            for a in ctx.parents_chain(node):
                if isinstance(a, ast.If) and child in a.body and _selects_bf16(ctx, a.test):
                    self.report(node, f"{q.rsplit('.', 1)[-1]} created when bfloat16 is selected "
                                      f"(`{ast.unparse(a.test)[:60]}`)")
                    break
                if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    break
                child = a
        self.generic_visit(node)


_STAT_CALLS = {"mean", "var", "var_mean", "std", "std_mean"}


def _squares_or_input(node: ast.AST, params: set[str]) -> str | None:
    """The forward input a statistic reads: ``x``, ``x * x``, ``x ** 2``, ``x.pow(2)``,
    ``x.square()``; None when it is cast (``x.float()``) or reads something else."""
    if isinstance(node, ast.Name):
        return node.id if node.id in params else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Pow)):
        return _squares_or_input(node.left, params)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("pow", "square"):
        return _squares_or_input(node.func.value, params)
    return None


class NormStatsInInputPrecision(RuleVisitor):
    """A normalization layer's forward (it takes a reciprocal square root) that either squares
    its input in the input's dtype before averaging (float16 squares overflow past 256,
    bfloat16's mean keeps 8 bits: litgpt's RMSNorm, detectron2's SyncBatchNorm), or adds to a
    variance in the input's dtype an eps that float16 cannot hold as a normal number (imagen's
    LayerNorm with eps=1e-5). torch's reductions accumulate in float32 internally, so a plain
    variance is not the hazard; its eps is. Model code's dtype is usually its callers' choice:
    without low precision among the code that uses it, the finding says so."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        ctx = self.ctx
        cls = ctx.parents.get(node)
        if node.name == "forward" and isinstance(cls, ast.ClassDef) and any(
                isinstance(c, ast.Call) and ((ctx.call_name(c) or "").rsplit(".", 1)[-1] in ("rsqrt", "sqrt")
                                             or isinstance(c.func, ast.Attribute) and c.func.attr in ("rsqrt", "sqrt"))
                for c in ast.walk(node)):
            params = {a.arg for a in node.args.args[1:]}
            upcast = {t.id for st in ast.walk(node) if isinstance(st, ast.Assign) and is_float32_cast(self.ctx, st.value)
                      for t in st.targets if isinstance(t, ast.Name)}
            note = "" if _lowp_evidence(ctx) else " (its dtype is decided by the model's callers: unknown)"
            for c in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                q = ctx.call_name(c) or ""
                method = isinstance(c.func, ast.Attribute) and c.func.attr in _STAT_CALLS and not q.startswith("torch.")
                if not (method or (q.startswith("torch.") and q.rsplit(".", 1)[-1] in _STAT_CALLS)) or _has_kw(c, "dtype"):
                    continue
                operand = c.func.value if method else (c.args[0] if c.args else None)  # type: ignore[union-attr]
                x = _squares_or_input(operand, params) if operand is not None else None
                if x is None or x in upcast:
                    continue
                what = c.func.attr if isinstance(c.func, ast.Attribute) else q.rsplit(".", 1)[-1]
                if what in ("mean", "sum") and not isinstance(operand, ast.Name):
                    self.report(c, f"{what}() of `{ast.unparse(operand)}`: squares taken in the input's "
                                   f"precision before rsqrt{note}")
                elif what.startswith(("var", "std")):
                    eps = _eps_added_to(ctx, node, cls, c)
                    if eps is not None and 0 < eps < FP16_MIN_NORMAL:
                        self.report(c, f"{what}() in the input's precision plus eps={eps:g}, below "
                                       f"float16's smallest normal ({FP16_MIN_NORMAL:.3g}){note}")
        self.generic_visit(node)


def _eps_added_to(ctx: FileContext, fn: ast.FunctionDef, cls: ast.ClassDef, stat: ast.Call) -> float | None:
    """The constant added to the variance ``stat`` computes (``var + self.eps`` with
    ``self.eps = eps`` and ``eps=1e-5`` in ``__init__``); None when it is not one number."""
    stmt = ctx.parents.get(stat)
    names = {t.id for t in getattr(stmt, "targets", []) if isinstance(t, ast.Name)}
    for n in ast.walk(fn):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
            sides = (n.left, n.right)
            if any((isinstance(x, ast.Name) and x.id in names) or x is stat for x in sides):
                other = n.right if (n.left is stat or (isinstance(n.left, ast.Name) and n.left.id in names)) else n.left
                return _number(ctx, other, cls)
    return None


def _number(ctx: FileContext, expr: ast.AST, cls: ast.ClassDef) -> float | None:
    v = _const_value(expr)
    if v is not None:
        return v
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
        for value, _ in ctx.values.class_attrs.get(cls, {}).get(expr.attr, []):
            if (c := _const_value(value)) is not None:
                return c
            init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if isinstance(value, ast.Name) and init is not None:
                a = init.args
                pos = [*a.posonlyargs, *a.args]
                defaults = dict(zip([p.arg for p in pos][len(pos) - len(a.defaults):], a.defaults))
                defaults.update({k.arg: d for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
                if value.id in defaults:
                    return _const_value(defaults[value.id])
    return None


@_per_module
def _lowp_evidence(ctx: FileContext) -> bool:
    """Low precision here or in the code that uses this module."""
    return ctx.uses_lowp or any(m.uses_lowp or m.apex_amp for m in ctx.project.users_of(ctx))


_FLOAT_TENSOR_TYPES = {"torch.cuda.FloatTensor", "torch.FloatTensor"}
_FACTORIES = {"zeros", "empty", "ones", "full", "rand", "randn"}


class Float32BufferForKernel(RuleVisitor):
    """A custom Function that hands a compiled kernel a buffer fixed to float32
    (``torch.cuda.FloatTensor(...)``, ``torch.zeros(..., dtype=torch.float32)``) beside its
    inputs: under autocast or a half model the inputs are float16 and the kernel reads both as
    one type (mmcv's three_interpolate)."""

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        ctx = self.ctx
        if _is_autograd_function(ctx, node):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in ("forward", "backward") \
                        and _dtype_sensitive(ctx, item) == "kernel":
                    for c in (n for n in ast.walk(item) if isinstance(n, ast.Call)):
                        q = ctx.call_name(c) or ""
                        fixed = q in _FLOAT_TENSOR_TYPES or (
                            q.startswith("torch.") and q.rsplit(".", 1)[-1] in _FACTORIES
                            and any(k.arg == "dtype" and ctx.dtype_of(k.value) == "float32" for k in c.keywords))
                        if fixed:
                            self.report(c, f"{q.rsplit('.', 1)[-1]}(...) fixes a kernel buffer to float32 "
                                           f"whatever the inputs' dtype")
        self.generic_visit(node)


_FILL_CALLS = ("masked_fill", "masked_fill_", "fill_", "full", "full_like", "new_full", "clamp",
               "clamp_", "where")


_FINFO_FLOAT32 = {"min": -float(np.finfo(np.float32).max), "max": float(np.finfo(np.float32).max)}


def _const_value(node: ast.AST) -> float | None:
    """A literal number, or ``torch.finfo(torch.float32).min/max`` (float32's extremes, which a
    float16 tensor cannot hold)."""
    if (isinstance(node, ast.Attribute) and node.attr in _FINFO_FLOAT32 and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "finfo"
            and node.value.args and dotted(node.value.args[0]) in ("torch.float32", "torch.float")):
        return _FINFO_FLOAT32[node.attr]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _const_value(node.operand)
        return -v if v is not None else None
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return float(node.value)
    return None


@_per_module
def _fp16_evidence(ctx: FileContext) -> bool:
    """This module trains in float16 (autocast's float16, or a float16 training cast), or,
    when it says nothing itself, a project module that imports it does (model code whose
    precision the training script decides)."""
    def own(c: FileContext) -> bool:
        return bool(c.fp16_autocast) or any(c.lowp_cast_dtype(x) == "float16" for x in training_lowp_casts(c))
    if own(ctx):
        return True
    if ctx.autocast_scopes or ctx.manual_lowp_casts:
        return False  # this module decides its own precision, and it is not float16
    return any(own(m) for m in ctx.project.users_of(ctx) if m is not ctx)


class Fp16UnsafeConstant(RuleVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = (ctx.call_name(node) or "").split(".")[-1]
        if name in _FILL_CALLS and _fp16_evidence(ctx):
            for a in list(node.args) + [k.value for k in node.keywords]:
                v = _const_value(a)
                if v is not None and abs(v) > FP16_MAX:
                    self.report(a, f"constant {v:g} in {name}() is outside the float16 range (±{FP16_MAX:g})")
        self.generic_visit(node)


_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "Adadelta", "RMSprop", "Adamax", "NAdam", "RAdam")


class EpsUnderflowFp16(RuleVisitor):
    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        if (ctx.call_name(node) or "").split(".")[-1] in _OPTIMIZERS and any(
                ctx.lowp_cast_dtype(c) == "float16" for c in training_lowp_casts(ctx)):
            for k in node.keywords:
                v = _const_value(k.value) if k.arg == "eps" else None
                if v is not None and 0 < v < FP16_MIN_SUBNORMAL:
                    self.report(k.value, f"optimizer eps={v:g} rounds to 0 in float16 parameters")
        self.generic_visit(node)


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    severity: Severity
    explanation: str
    suggestion: str
    visitor: type[RuleVisitor]


RULES: tuple[Rule, ...] = (
    Rule("AMP001", "manual-cast", Severity.HIGH,
         "A manual cast to float16/bfloat16 in AMP code bypasses autocast's per-op precision "
         "choice (ops autocast would keep in float32 now run in low precision).",
         "Remove the cast and let `with torch.autocast(...)` choose; keep master weights in float32.",
         ManualCast),
    Rule("AMP002", "bce-under-autocast", Severity.HIGH,
         "binary_cross_entropy / BCELoss is unsafe under CUDA autocast (PyTorch raises an error): "
         "the log of a float16 probability saturates.",
         "Use binary_cross_entropy_with_logits / BCEWithLogitsLoss on the raw logits.",
         BceUnderAutocast),
    Rule("AMP003", "loss-outside-autocast", Severity.HIGH,
         "The loss is computed outside the autocast block on its low-precision outputs, so it runs "
         "in float16/bfloat16 instead of autocast's float32 loss kernels (type mismatch, lost precision).",
         "Compute the loss inside the `with autocast(...)` block, or cast the outputs with .float() first.",
         LossOutsideAutocast),
    Rule("AMP004", "softmax-without-dtype", Severity.MEDIUM,
         "softmax/log_softmax without dtype= runs in the input's low precision here (CUDA autocast "
         "promotes it, CPU bf16 autocast and manual casts do not); exp() overflows in float16.",
         "Pass dtype=torch.float32 (e.g. F.softmax(x, dim=-1, dtype=torch.float32)).",
         SoftmaxNoDtype),
    Rule("AMP005", "reduction-outside-autocast", Severity.MEDIUM,
         "sum/mean on a low-precision tensor outside autocast returns float16/bfloat16; large "
         "reductions lose the small terms (big numbers eat small ones).",
         "Reduce in float32: x.float().sum() or x.sum(dtype=torch.float32), or keep it inside autocast.",
         ReductionOutsideAutocast),
    Rule("AMP006", "autograd-function-no-custom-fwd", Severity.MEDIUM,
         "A custom torch.autograd.Function in AMP code receives whatever dtypes autocast produced; "
         "without custom_fwd/custom_bwd its backward may run with different dtypes than forward.",
         "Decorate forward with @torch.amp.custom_fwd(device_type=...) and backward with "
         "@torch.amp.custom_bwd(device_type=...).",
         AutogradFunctionNoCustomFwd),
    Rule("AMP007", "deprecated-amp-api", Severity.LOW,
         "torch.cuda.amp.* and torch.cpu.amp.* are deprecated aliases and emit FutureWarning.",
         "Use torch.amp.autocast(device_type, ...), torch.amp.GradScaler(device_type) and "
         "torch.amp.custom_fwd/custom_bwd(device_type=...).",
         DeprecatedAmpApi),
    Rule("AMP008", "fp16-without-gradscaler", Severity.HIGH,
         "float16 gradients underflow to zero (smallest subnormal ~6e-8) without loss scaling; "
         "CUDA autocast defaults to float16.",
         "Use torch.amp.GradScaler: scaler.scale(loss).backward(); scaler.step(opt); scaler.update(), "
         "or train in bfloat16.",
         Fp16WithoutGradScaler),
    Rule("AMP009", "backward-inside-autocast", Severity.LOW,
         "Backward passes under autocast are not recommended: backward ops already run in the "
         "dtype autocast chose for the matching forward op.",
         "Leave the `with autocast(...)` block before calling loss.backward().",
         BackwardInAutocast),
    Rule("AMP010", "clip-without-unscale", Severity.MEDIUM,
         "With a GradScaler the gradients are multiplied by the scale; clipping them before "
         "scaler.unscale_ clips against the wrong norm.",
         "Call scaler.unscale_(optimizer) before clip_grad_norm_, then scaler.step(optimizer).",
         ClipWithoutUnscale),
    Rule("AMP011", "fp16-unsafe-constant", Severity.MEDIUM,
         "A constant beyond ±65504 becomes ±inf in float16; -1e9 attention masks give NaN rows "
         "after softmax.",
         "Use torch.finfo(x.dtype).min / max instead of a fixed constant.",
         Fp16UnsafeConstant),
    Rule("AMP012", "eps-underflow-fp16", Severity.MEDIUM,
         "An optimizer eps below float16's smallest subnormal (~6e-8) is zero for float16 "
         "parameters, so the update divides by sqrt(v) alone.",
         "Keep float32 master weights (autocast + GradScaler), or use eps >= 1e-4 with float16 parameters.",
         EpsUnderflowFp16),
    Rule("AMP013", "unscale-every-micro-step", Severity.MEDIUM,
         "With gradient accumulation, scaler.unscale_ must run only on the micro-step that calls "
         "scaler.step: a second unscale_ before update() raises, and later micro-batches add "
         "scaled gradients onto already unscaled ones.",
         "Put unscale_ (and the clipping after it) under the same condition as scaler.step/update.",
         UnscaleEveryMicroStep),
    Rule("AMP014", "autocast-wrapped-forward", Severity.MEDIUM,
         "Wrapping a model's forward in autocast returns its float16/bfloat16 outputs to code "
         "outside autocast: a loss computed there runs in low precision.",
         "Convert the wrapped forward's outputs to float32 (or compute the loss under autocast).",
         AutocastWrappedForward),
    Rule("AMP015", "gradscaler-with-bf16", Severity.LOW,
         "bfloat16 has float32's exponent range; a GradScaler on the bfloat16 path only adds inf "
         "checks and skipped steps.",
         "Create the GradScaler for float16 only (or pass enabled=(dtype == torch.float16)).",
         GradScalerWithBf16),
    Rule("AMP016", "norm-stats-in-input-precision", Severity.MEDIUM,
         "A normalization that squares its input in float16/bfloat16 before averaging loses the "
         "statistic (squares overflow float16 past 256; bfloat16 keeps 8 significant bits), and "
         "an eps below float16's normal range (6.1e-5) added to a float16 variance does not keep "
         "rsqrt finite; the reciprocal square root amplifies either error.",
         "Compute the statistics in float32 (x.float().pow(2).mean(...)) and cast back, or use "
         "eps >= 1e-3 when the input is not float32.",
         NormStatsInInputPrecision),
    Rule("AMP017", "float32-buffer-for-kernel", Severity.MEDIUM,
         "A compiled kernel reads all its operands as one scalar type; a buffer allocated as "
         "float32 next to float16 inputs (autocast, a half model) is misread or rejected.",
         "Allocate from the input: x.new_empty(...), torch.zeros_like(x), or dtype=x.dtype.",
         Float32BufferForKernel),
)
RULES_BY_ID = {r.id: r for r in RULES}
RULES_BY_NAME = {r.name: r for r in RULES}
