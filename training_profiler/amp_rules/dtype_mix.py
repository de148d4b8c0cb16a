"""AMP021: a float32 tensor made or kept beside the activations of a low-precision model.

Autocast makes mixed dtypes harmless for the ops it lists; a model that runs in float16 or
bfloat16 itself (``model.half()``, a pipeline's ``torch_dtype``, a hand-written fp16 trainer)
has no autocast to reconcile them. Public projects fixed two shapes of it:

- a helper tensor built in the default float32 (``torch.linspace``, ``torch.zeros``,
  ``torch.Tensor([...])``) and moved to the activations' *device* only (``.to(device)``,
  ``.to(device=x.device)``): positions and cached masks that meet half-precision features in a
  matmul or a kernel (mmcv's generalized attention, fairseq's future mask);
- scores upcast to float32 for a normalising sum and then multiplied with the low-precision
  values without casting back (diffusers' Sana linear attention);
- a registered buffer (a KV cache) written in place with the activations (``index_copy_``,
  ``copy_``) while it keeps the dtype it was created with; under autocast the keys and values
  arrive in low precision (litgpt's KV cache).

Confidence: HIGH when the module (or a module that uses it) trains float16 parameters, MEDIUM
when the project does elsewhere, LOW when no low-precision model is seen (the message says so).
"""
from __future__ import annotations

import ast

from training_profiler.amp_context import FileContext
from training_profiler.amp_intent import float32_result, is_float32_cast
from training_profiler.amp_precision import (
    activation_dtype_tests,
    expects_lowp_activations,
    lowp_parameters,
)
from training_profiler.amp_rules.base import Confidence, Rule, RuleVisitor, Severity, declare_rule

_FACTORIES = {"torch.linspace", "torch.logspace", "torch.zeros", "torch.ones", "torch.empty", "torch.full",
              "torch.rand", "torch.randn", "torch.eye", "torch.Tensor", "torch.FloatTensor"}
_MATMULS = {"torch.matmul", "torch.bmm", "torch.mm"}
_DTYPE_SETTERS = {"to", "type", "type_as", "half", "bfloat16", "float", "double"}
_NOT_MODEL_CODE = ("__init__", "reset_parameters", "_init_weights", "init_weights")


def _float32_factory(ctx: FileContext, node: ast.AST) -> bool:
    """A call that makes a float32 tensor by default: no ``dtype=``, not ``*_like``."""
    if not isinstance(node, ast.Call) or any(k.arg == "dtype" for k in node.keywords):
        return False
    name = ctx.call_name(node) or ""
    if name in _FACTORIES:
        return True
    if name == "torch.arange":  # float only with a float bound (``feat_dim / 4``, ``0.5``)
        return any(isinstance(a, ast.BinOp) and isinstance(a.op, ast.Div) or
                   isinstance(a, ast.Constant) and isinstance(a.value, float) for a in node.args)
    return False


def _device_only_move(ctx: FileContext, call: ast.Call) -> bool:
    """``.to(device)``, ``.to(x.device)``, ``.to(device=...)``, ``.cuda()``: nothing sets a dtype."""
    f = call.func
    if not isinstance(f, ast.Attribute):
        return False
    if f.attr == "cuda":
        return True
    if f.attr != "to" or any(k.arg == "dtype" for k in call.keywords) or len(call.args) > 1:
        return False
    if call.args:
        text = ast.unparse(call.args[0])
        return text.split(".")[-1].startswith("device") and ctx.dtype_of(call.args[0]) in (None, "unknown")
    return any(k.arg == "device" for k in call.keywords)


def _model_method(ctx: FileContext, node: ast.AST) -> ast.AST | None:
    fn = ctx.enclosing_function(node)
    if fn is ctx.tree or getattr(fn, "name", "") in _NOT_MODEL_CODE or ctx.values.enclosing_class(node) is None:
        return None
    return fn


def _confidence(ctx: FileContext) -> tuple[Confidence, str]:
    if lowp_parameters(ctx) or any(lowp_parameters(m) for m in ctx.project.users_of(ctx) if m is not ctx):
        return Confidence.HIGH, ""
    expects = expects_lowp_activations(ctx)
    if expects:
        return Confidence.HIGH, expects
    if any(lowp_parameters(m) for m in ctx.project.modules.values()):
        return Confidence.MEDIUM, " (a float16 model is trained elsewhere in the project)"
    if any(activation_dtype_tests(m) for m in ctx.project.modules.values()):
        return Confidence.MEDIUM, " (code elsewhere in the project expects low-precision tensors)"
    return Confidence.LOW, " (no half-precision model seen; if the model runs in float16/bfloat16 without autocast, " \
                           "this is a dtype mismatch or a silent upcast)"


# ---- float32 values of a name, within one function ------------------------------------------------
def _assignments(fn: ast.AST, name: str, before: int) -> list[ast.Assign]:
    return sorted((st for st in ast.walk(fn) if isinstance(st, ast.Assign) and st.lineno < before
                   and any(isinstance(t, ast.Name) and t.id == name for t in st.targets)), key=lambda s: s.lineno)


def _float32_name(ctx: FileContext, fn: ast.AST, name: str, line: int, depth: int = 0) -> bool:
    """The last value bound to ``name`` before ``line`` is float32: an explicit float32 cast,
    or arithmetic on a float32 value of the same name (``s = s / (s.sum(...) + eps)``)."""
    binds = _assignments(fn, name, line)
    if not binds or depth > 4:
        return False
    value = binds[-1].value
    if float32_result(ctx, value):
        return True
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Div, ast.Mult, ast.Add, ast.Sub)):
        here = binds[-1].lineno
        return any(isinstance(n, ast.Name) and n.id == name and _float32_name(ctx, fn, name, here, depth + 1)
                   for n in (value.left, value.right))
    return False


def _matmul_pair(ctx: FileContext, node: ast.AST) -> tuple[ast.AST, ast.AST] | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return node.left, node.right
    if isinstance(node, ast.Call) and (ctx.call_name(node) or "") in _MATMULS and len(node.args) == 2:
        return node.args[0], node.args[1]
    return None


def _parameter_names(fn: ast.AST) -> set[str]:
    a = getattr(fn, "args", None)
    return {x.arg for x in (a.posonlyargs + a.args + a.kwonlyargs)} - {"self"} if a else set()


_IN_PLACE_WRITES = ("index_copy_", "index_put_", "scatter_", "copy_", "masked_scatter_")


def _buffers(cls: ast.ClassDef) -> dict[str, ast.AST]:
    """``self.register_buffer("k", <value>)`` in the class: buffer name -> the value it starts as."""
    out = {}
    for c in ast.walk(cls):
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "register_buffer" \
                and len(c.args) >= 2 and isinstance(c.args[0], ast.Constant) and isinstance(c.args[0].value, str):
            out[c.args[0].value] = c.args[1]
    return out


def _recast_before(fn: ast.AST, attr: str, line: int) -> bool:
    """``self.k = self.k.to(k.dtype)`` (or any rebinding of the buffer) earlier in the function."""
    return any(isinstance(st, ast.Assign) and st.lineno < line and any(
        isinstance(t, ast.Attribute) and t.attr == attr for t in st.targets) for st in ast.walk(fn))


@declare_rule(
    "AMP021", "float32-beside-lowp-activations", Severity.MEDIUM,
    explanation=("A tensor left in float32 meets the activations of a model that runs in float16/bfloat16 "
                 "without autocast: a matmul or kernel refuses the mixed dtypes, or the result is silently "
                 "upcast and the next layer gets float32."),
    suggestion=("Create helper tensors in the activations' dtype and device (`torch.linspace(..., "
                "dtype=x.dtype, device=x.device)`, `mask.to(x)`), and cast float32 intermediates back "
                "(`scores.to(value.dtype)`) before they meet low-precision tensors."))
class Float32BesideActivations(RuleVisitor):
    """Both shapes of the module docstring, in methods of classes (model code), outside autocast."""

    def run(self):
        ctx = self.ctx
        self._moved_in: set[ast.AST] = set()  # one device-only finding per function: one hazard
        for node in sorted((n for n in ctx.nodes if isinstance(n, (ast.Call, ast.BinOp))),
                           key=lambda n: (n.lineno, n.col_offset)):
            if isinstance(node, ast.Call) and _device_only_move(ctx, node):
                self._moved_factory(node)
            elif isinstance(node, (ast.Call, ast.BinOp)):
                self._upcast_operand(node)
            if isinstance(node, ast.Call):
                self._buffer_write(node)
        return self.hits

    def _buffer_write(self, call: ast.Call) -> None:
        ctx = self.ctx
        f = call.func
        if not (isinstance(f, ast.Attribute) and f.attr in _IN_PLACE_WRITES and isinstance(f.value, ast.Attribute)
                and isinstance(f.value.value, ast.Name) and f.value.value.id == "self"):
            return
        fn, cls = _model_method(ctx, call), ctx.values.enclosing_class(call)
        made = _buffers(cls).get(f.value.attr) if cls is not None else None
        if fn is None or made is None or _recast_before(fn, f.value.attr, call.lineno):
            return
        written = [a for a in call.args if isinstance(a, ast.Name) and a.id in _parameter_names(fn)]
        if not written:
            return
        conf, note = _confidence(ctx)
        if conf != Confidence.HIGH:
            conf, note = (Confidence.MEDIUM, " (under the autocast of the code that uses it)") \
                if ctx.project_uses_amp or ctx.uses_amp else \
                (Confidence.LOW, " (no autocast seen; under autocast it arrives in low precision)")
        self.report(call, f"buffer `self.{f.value.attr}` keeps the dtype it was registered with while "
                          f"`{written[-1].id}` is written into it in place{note}", conf)

    def _moved_factory(self, call: ast.Call) -> None:
        ctx = self.ctx
        recv = call.func.value
        made = next((n for n in ast.walk(recv) if _float32_factory(ctx, n)), None)
        after = ctx.parents.get(call)
        if isinstance(after, ast.Attribute) and after.attr in _DTYPE_SETTERS:
            return  # ``.to(device=d).to(dtype=x.dtype)``: the dtype follows in the same expression
        fn = _model_method(ctx, call) if made is not None else None
        if fn is None or fn in self._moved_in or ctx.in_autocast(call):
            return
        self._moved_in.add(fn)
        conf, note = _confidence(ctx)
        self.report(call, f"`{ast.unparse(made)[:40]}` is float32 and moved to the device only, not to the "
                          f"activations' dtype{note}", conf)

    def _upcast_operand(self, node: ast.AST) -> None:
        ctx = self.ctx
        pair = _matmul_pair(ctx, node)
        fn = _model_method(ctx, node) if pair else None
        if fn is None or ctx.in_autocast(node):
            return
        params = _parameter_names(fn)
        for mine, other in (pair, pair[::-1]):
            if isinstance(mine, ast.Name) and isinstance(other, ast.Name) and other.id in params \
                    and not is_float32_cast(ctx, other) and _float32_name(ctx, fn, mine.id, node.lineno) \
                    and not _assignments(fn, other.id, node.lineno):
                conf, note = _confidence(ctx)
                self.report(node, f"`{mine.id}` was upcast to float32 and meets `{other.id}` (the activations, "
                                  f"not cast) in a matmul outside autocast{note}", conf)
                return


RULES: tuple[Rule, ...] = (Float32BesideActivations.rule,)
