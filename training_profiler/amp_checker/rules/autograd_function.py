"""Custom ``torch.autograd.Function``s and the compiled kernels they call: no custom_fwd /
custom_bwd where operands can differ in dtype (AMP006), a kernel buffer fixed to float32
(AMP017)."""
from __future__ import annotations

import ast

from quant.vocabulary import Severity
from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.rules.base import Confidence, Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import cast_inputs_dtype

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
    return len(_kernel_operands(ctx, forward, {p for p in params if not any(w in p.lower() for w in _NOT_FLOAT_OPERAND)}))


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


@declare_rule(
    "AMP006", "autograd-function-no-custom-fwd", Severity.MEDIUM,
    explanation=(
        "A custom torch.autograd.Function in AMP code receives whatever dtypes autocast produced; "
        "without custom_fwd/custom_bwd its backward may run with different dtypes than forward."),
    suggestion=(
        "Decorate forward with @torch.amp.custom_fwd(device_type=...) and backward with "
        "@torch.amp.custom_bwd(device_type=...)."))
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
            if mixes and forward is not None:
                casts, left = _unified_operands(ctx, node, forward)
                mixes = not casts or bool(left)  # its own casts make every kernel operand agree
            if not amp_here and not any(isinstance(i, ast.FunctionDef) and i.name == "backward" for i in node.body):
                mixes = False  # no backward: an inference or export op (mmcv's NMS), off the training path
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
                    conf = Confidence.HIGH if amp_here else Confidence.MEDIUM
                    sibling = None if _applied_under_autocast(ctx, node) else _decorated_sibling(ctx, node)
                    if sibling:
                        note = (f" (`{sibling}` in this module is decorated: its authors chose per Function, "
                                "and a kernel may take mixed dtypes by design)")
                        conf = Confidence.LOW
                    self.report(item, f"autograd.Function {node.name}.{item.name} without @{want}{note}", conf)
        self.generic_visit(node)


def _applied_under_autocast(ctx: FileContext, cls: ast.ClassDef) -> bool:
    """``cls.apply(...)`` is called inside an autocast region of this module: the mixed
    dtypes reach it, whatever its authors chose."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "apply"
               and isinstance(n.func.value, ast.Name) and n.func.value.id == cls.name and ctx.in_autocast(n)
               for n in ctx.nodes)


def _decorated_sibling(ctx: FileContext, cls: ast.ClassDef) -> str | None:
    """Another autograd Function of the module whose forward or backward carries custom_fwd /
    custom_bwd: the module handles autocast Function by Function (mamba's MambaInnerFn beside
    the selective scan whose kernel takes half inputs with float32 weights), so an undecorated
    one there is more likely a choice than an oversight."""
    for other in ctx.nodes:
        if isinstance(other, ast.ClassDef) and other is not cls and _is_autograd_function(ctx, other) and any(
                isinstance(i, ast.FunctionDef) and any(
                    (ctx.qualname(d.func if isinstance(d, ast.Call) else d) or "").split(".")[-1]
                    in ("custom_fwd", "custom_bwd") for d in i.decorator_list)
                for i in other.body):
            return other.name
    return None


def _unified_operands(ctx: FileContext, cls: ast.ClassDef, forward: ast.FunctionDef
                      ) -> tuple[list[tuple[ast.stmt, tuple[str, str]]], list[str]]:
    """forward's unifying casts (``weight = weight.type_as(input)``) and the differentiable
    kernel operands they leave out, sorted: no casts, nothing unified; casts and nothing left,
    the Function makes its operands agree itself (mmcv's fixed deformable convolutions)."""
    params = {a.arg for a in forward.args.args[1:]}
    casts = [(st, pair) for st in forward.body if (pair := _unifying_cast(st, params))]
    if not casts:
        return [], []
    touched = {a for _, (a, _) in casts} | {b for _, (_, b) in casts}
    return casts, sorted(_kernel_operands(ctx, forward, _differentiable_inputs(cls, forward)) - touched)


def _unifying_cast(stmt: ast.stmt, params: set[str]) -> tuple[str, str] | None:
    """``a = a.type_as(b)`` / ``a = a.to(b.dtype)`` / ``a = a.to(dtype=b.dtype)`` on a parameter
    ``a``: (a, b), the operand cast and the tensor whose dtype it takes."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute)):
        return None
    name, call = stmt.targets[0].id, stmt.value
    if name not in params or not (isinstance(call.func.value, ast.Name) and call.func.value.id == name):
        return None
    source = [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")]
    if call.func.attr == "type_as" and len(source) == 1 and isinstance(source[0], ast.Name):
        return name, source[0].id
    if call.func.attr == "to" and len(source) == 1 and isinstance(source[0], ast.Attribute) \
            and source[0].attr == "dtype" and isinstance(source[0].value, ast.Name):
        return name, source[0].value.id
    return None


def _differentiable_inputs(cls: ast.ClassDef, forward: ast.FunctionDef) -> set[str]:
    """forward's inputs that backward returns a gradient for (not ``None`` at their position):
    float tensors, whatever they are called."""
    backward = next((i for i in cls.body if isinstance(i, ast.FunctionDef) and i.name == "backward"), None)
    if backward is None:
        return set()
    names = [a.arg for a in forward.args.args[1:]]
    out: set[str] = set()
    for ret in (n for n in ast.walk(backward) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)):
        out |= {name for name, g in zip(names, ret.value.elts)
                if not (isinstance(g, ast.Constant) and g.value is None)}
    return out


def _kernel_operands(ctx: FileContext, fn: ast.FunctionDef, names: set[str]) -> set[str]:
    """Which of ``names`` are handed to a compiled kernel call in ``fn`` (directly or through
    ``x.contiguous()``-style calls)."""
    used: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and _call_is_kernel(ctx, n):
            for a in [*n.args, *(k.value for k in n.keywords)]:
                root = a
                while isinstance(root, ast.Call) and isinstance(root.func, ast.Attribute):
                    root = root.func.value  # x.contiguous(), x.float()
                if isinstance(root, ast.Name) and root.id in names:
                    used.add(root.id)
    return used


class PartialDtypeCasts(RuleVisitor):
    """AMP006 where a Function's own casts show that its inputs arrive in mixed dtypes: forward
    casts some operands to one tensor's dtype (``weight = weight.type_as(input)``) and hands
    another float input (one backward returns a gradient for) to the same compiled kernel
    uncast: under autocast that one still comes in float16 while the rest are float32, or the
    other way round (mmcv's deformable convolutions, twice)."""

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        ctx = self.ctx
        forward = next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "forward"), None)
        if forward is not None and _is_autograd_function(ctx, node) and cast_inputs_dtype(ctx, forward) is None:
            casts, left = _unified_operands(ctx, node, forward)
            if casts:
                cast = {a for _, (a, _) in casts}
                if left:
                    last = casts[-1][0]
                    shown = ", ".join(f"`{x}`" for x in sorted(cast))
                    self.report(last, f"{node.name}.forward casts {shown} to one dtype but hands "
                                      f"{', '.join(f'`{x}`' for x in left)} to the kernel uncast: the inputs "
                                      "arrive in mixed dtypes (the casts say so) and this one is left out")
        self.generic_visit(node)


_FLOAT_TENSOR_TYPES = {"torch.cuda.FloatTensor", "torch.FloatTensor"}
_FACTORIES = {"zeros", "empty", "ones", "full", "rand", "randn"}


@declare_rule(
    "AMP017", "float32-buffer-for-kernel", Severity.MEDIUM,
    explanation=(
        "A compiled kernel reads all its operands as one scalar type; a buffer allocated as "
        "float32 next to float16 inputs (autocast, a half model) is misread or rejected."),
    suggestion="Allocate from the input: x.new_empty(...), torch.zeros_like(x), or dtype=x.dtype.")
class Float32BufferForKernel(RuleVisitor):
    """A custom Function that hands a compiled kernel a buffer fixed to float32
    (``torch.cuda.FloatTensor(...)``, ``torch.zeros(..., dtype=torch.float32)``) beside its
    inputs: under autocast or a half model the inputs are float16 and the kernel reads both as
    one type (mmcv's three_interpolate). A default for an absent input (``if f is None: f =
    torch.ones(..., dtype=torch.float32)``) is not a buffer: it stands for what callers pass,
    a float32 filter for StyleGAN's upfirdn2d and filtered_lrelu kernels."""

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        ctx = self.ctx
        if _is_autograd_function(ctx, node):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in ("forward", "backward") \
                        and _dtype_sensitive(ctx, item) == "kernel":
                    params = {a.arg for a in item.args.args}
                    for c in (n for n in ast.walk(item) if isinstance(n, ast.Call) and not _default_for(ctx, n, params)):
                        q = ctx.call_name(c) or ""
                        fixed = q in _FLOAT_TENSOR_TYPES or (
                            q.startswith("torch.") and q.rsplit(".", 1)[-1] in _FACTORIES
                            and any(k.arg == "dtype" and ctx.dtype_of(k.value) == "float32" for k in c.keywords))
                        if fixed:
                            self.report(c, f"{q.rsplit('.', 1)[-1]}(...) fixes a kernel buffer to float32 "
                                           f"whatever the inputs' dtype")
        self.generic_visit(node)


def _default_for(ctx: FileContext, call: ast.Call, params: set[str]) -> bool:
    """``f = torch.ones(...)``: the call rebinds one of the function's own parameters."""
    stmt = ctx.parents.get(call)
    return isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id in params for t in stmt.targets)


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (AutogradFunctionNoCustomFwd.rule, Float32BufferForKernel.rule,)
