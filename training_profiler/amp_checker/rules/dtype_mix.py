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
import re

from quant.vocabulary import Severity
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import float32_result, is_float32_cast
from training_profiler.amp_checker.precision import (
    activation_dtype_tests,
    expects_lowp_activations,
    in_model_library,
    lowp_parameters,
)
from training_profiler.amp_checker.rules.base import (
    LIBRARY_NOTE,
    Confidence,
    Rule,
    RuleVisitor,
    declare_rule,
)
from training_profiler.amp_checker.rules.helpers import classes_calling, registered_buffers

_FACTORIES = {"torch.linspace", "torch.logspace", "torch.zeros", "torch.ones", "torch.empty", "torch.full",
              "torch.rand", "torch.randn", "torch.eye", "torch.Tensor", "torch.FloatTensor"}
_GRIDS = {"torch.eye", "torch.linspace", "torch.logspace", "torch.arange"}
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


def _made_on_activations_device(ctx: FileContext, call: ast.Call) -> bool:
    """``torch.eye(n, device=x.device)`` with ``x`` an input of a ``forward``: an identity or a grid
    that follows the activations' device and not their dtype (peft's BOFT rotation). Zeros and
    ones are left out: masks and accumulators are float32 by choice as often as not."""
    dev = next((k.value for k in call.keywords if k.arg == "device"), None)
    if not (isinstance(dev, ast.Attribute) and dev.attr == "device" and isinstance(dev.value, ast.Name)
            and (ctx.call_name(call) or "") in _GRIDS and _float32_factory(ctx, call)):
        return False
    fn = _model_method(ctx, call)
    return fn is not None and getattr(fn, "name", "") == "forward" and dev.value.id in _parameter_names(fn)


def _device_only_move(ctx: FileContext, call: ast.Call) -> bool:
    """``.to(device)``, ``.to(x.device)``, ``.to("cuda")``, ``.to(device=...)``, ``.cuda()``:
    nothing sets a dtype."""
    f = call.func
    if not isinstance(f, ast.Attribute):
        return False
    if f.attr == "cuda":
        return True
    if f.attr != "to" or any(k.arg == "dtype" for k in call.keywords) or len(call.args) > 1:
        return False
    if call.args and isinstance(call.args[0], ast.Constant):
        return isinstance(call.args[0].value, str)  # a device by name ("cuda:0"); a dtype is never a string
    if call.args:
        text = ast.unparse(call.args[0])
        return text.split(".")[-1].startswith("device") and ctx.dtype_of(call.args[0]) in (None, "unknown")
    return any(k.arg == "device" for k in call.keywords)


# an identity or grid made on the input's device is low confidence: the input of a forward is
# as often a module's own float32 weights (peft's multiplicative dropout of its rotation
# blocks) as half activations, and nothing in the method tells them apart
_GRID_NOTE = " (low: the input may be float32 weights rather than activations)"


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
    if any(lowp_parameters(m) for m in ctx.project.program_modules(ctx)):
        return Confidence.MEDIUM, " (a float16 model is trained elsewhere in the project)"
    if any(activation_dtype_tests(m) for m in ctx.project.program_modules(ctx)):
        return Confidence.MEDIUM, " (code elsewhere in the project expects low-precision tensors)"
    if in_model_library(ctx):
        return Confidence.MEDIUM, LIBRARY_NOTE.format(
            why="in a float16/bfloat16 model without autocast this is a dtype mismatch or a silent upcast")
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
            elif isinstance(node, ast.Call) and _made_on_activations_device(ctx, node):
                self._moved_factory(node, made=node)
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
        made = registered_buffers(cls).get(f.value.attr) if cls is not None else None
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

    def _moved_factory(self, call: ast.Call, made: ast.Call | None = None) -> None:
        ctx = self.ctx
        how = "made on the activations' device only" if made is not None else "moved to the device only"
        made = made or next((n for n in ast.walk(call.func.value) if _float32_factory(ctx, n)), None)
        after = ctx.parents.get(call)
        if isinstance(after, ast.Attribute) and after.attr in _DTYPE_SETTERS:
            return  # ``.to(device=d).to(dtype=x.dtype)``: the dtype follows in the same expression
        fn = _model_method(ctx, call) if made is not None else None
        if fn is None or fn in self._moved_in or ctx.in_autocast(call):
            return
        self._moved_in.add(fn)
        conf, note = _confidence(ctx)
        if call is made:  # the grid shape: 0 of 2 right on the real-code sets (bench/realcode)
            conf, note = Confidence.LOW, note + _GRID_NOTE
        self.report(call, f"`{ast.unparse(made)[:40]}` is float32 and {how}, not to the "
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


def _lowp_move(ctx: FileContext, call: ast.Call) -> tuple[str, str] | None:
    """``vae.to(device, dtype=weight_dtype)`` / ``vae.half()`` as a statement (in place: a
    module): (the module's name, the dtype as written) when the dtype may be float16/bfloat16."""
    f = call.func
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
            and isinstance(ctx.parents.get(call), ast.Expr)):
        return None
    dtype = ctx.lowp_cast_dtype(call)
    if dtype is None:
        return None
    written = next((a for a in [*(k.value for k in call.keywords if k.arg == "dtype"), *call.args]
                    if ctx.dtype_of(a) == dtype), None)
    return f.value.id, ast.unparse(written) if written is not None else dtype


_NOT_FLOAT_KEYS = re.compile(r"ids?$|_ids|mask|label|token|index|len|caption|text", re.I)


def _loader_tensor(ctx: FileContext, expr: ast.AST) -> ast.Subscript | None:
    """``batch["images"]`` or ``batch["images"].to(device)``: a data-loader tensor, still float32
    (not token ids, masks or labels, which are integers): the subscript."""
    if isinstance(expr, ast.Call) and _device_only_move(ctx, expr):
        expr = expr.func.value
    if not (isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name) and "batch" in expr.value.id
            and isinstance(expr.slice, ast.Constant) and isinstance(expr.slice.value, str)):
        return None
    return None if _NOT_FLOAT_KEYS.search(expr.slice.value) else expr


def _recast_targets(ctx: FileContext, fn: ast.AST) -> dict[str, int]:
    """``batch["x"] = batch["x"].to(device, dtype=weight_dtype)``: the text of each target given a
    dtype cast in ``fn``, with its line."""
    out: dict[str, int] = {}
    for st in ast.walk(fn):
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.value, ast.Call) \
                and isinstance(st.value.func, ast.Attribute) and (
                    st.value.func.attr in _DTYPE_SETTERS - {"to", "type_as"}
                    or any(k.arg == "dtype" for k in st.value.keywords)
                    or any(ctx.dtype_of(a) not in (None, "unknown") for a in st.value.args)):
            out.setdefault(ast.unparse(st.targets[0]), st.lineno)
    return out


class BatchIntoLowpModel(RuleVisitor):
    """AMP021 in a training script: a module moved to a low-precision dtype (``ae.to(device,
    dtype=weight_dtype)``) called on a batch tensor the loader made float32, outside autocast
    (sd-scripts' FLUX training encoded uncached images this way)."""

    def run(self):
        ctx = self.ctx
        movers = {id(ctx.enclosing_function(c)) for c in ctx.calls if _lowp_move(ctx, c)}
        for fn in (n for n in ctx.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and id(n) in movers):
            moved: dict[str, tuple[int, str]] = {}
            recast = _recast_targets(ctx, fn)
            calls = sorted((c for c in ast.walk(fn) if isinstance(c, ast.Call) and ctx.enclosing_function(c) is fn),
                           key=lambda c: (c.lineno, c.col_offset))
            for c in calls:
                move = _lowp_move(ctx, c)
                if move is not None:
                    moved.setdefault(move[0], (c.lineno, move[1]))
                    continue
                target = c.func.value if isinstance(c.func, ast.Attribute) else c.func
                name = target.id if isinstance(target, ast.Name) else None
                batch = _loader_tensor(ctx, c.args[0]) if name in moved and c.args else None
                if batch is not None and recast.get(ast.unparse(batch), c.lineno) >= c.lineno \
                        and not ctx.in_autocast(c):
                    line, dtype = moved[name]
                    self.report(c, f"`{ast.unparse(c.args[0])}` comes from the loader in float32 and goes into "
                                   f"`{name}`, moved to `{dtype}` at line {line}, outside autocast")
        return self.hits


def _weight_copy(expr: ast.AST) -> bool:
    """``emb.weight.data.detach().clone()`` / ``layer.weight.clone()``: a copy of a weight."""
    cur, saw_clone = expr, False
    while isinstance(cur, ast.Call) and isinstance(cur.func, ast.Attribute) and cur.func.attr in ("clone", "detach"):
        saw_clone |= cur.func.attr == "clone"
        cur = cur.func.value
    if isinstance(cur, ast.Attribute) and cur.attr == "data":
        cur = cur.value
    return saw_clone and isinstance(cur, ast.Attribute) and cur.attr == "weight"


def _weight_target(target: ast.AST) -> bool:
    """``...weight[idx]`` / ``...weight.data[idx]``: an indexed write into a weight."""
    if not isinstance(target, ast.Subscript):
        return False
    base = target.value.value if isinstance(target.value, ast.Attribute) and target.value.attr == "data" \
        else target.value
    return isinstance(base, ast.Attribute) and base.attr == "weight"


class StaleCopyWrittenBack(RuleVisitor):
    """AMP021 in a training script: a copy of a module's weights taken while it is float32, the
    module then cast to a low-precision dtype, and the copy written back into its weights
    (sd-scripts' textual inversion restored frozen token embeddings this way under full_fp16)."""

    def run(self):
        ctx = self.ctx
        copying = {id(ctx.enclosing_function(n)) for n in ctx.nodes if isinstance(n, ast.Assign) and _weight_copy(n.value)}
        for fn in (n for n in ctx.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and id(n) in copying):
            copies: dict[str, tuple[int, set[str]]] = {}
            casts: list[tuple[int, str, str]] = []
            for st in sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.Expr))), key=lambda n: n.lineno):
                if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) \
                        and _weight_copy(st.value):
                    copies.setdefault(st.targets[0].id, (st.lineno, {n.id for n in ast.walk(st.value)
                                                                     if isinstance(n, ast.Name)}))
                elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and (move := _lowp_move(ctx, st.value)):
                    casts.append((st.lineno, move[0], move[1]))
                elif isinstance(st, ast.Assign) and len(st.targets) == 1 and _weight_target(st.targets[0]) \
                        and isinstance(st.value, ast.Subscript) and isinstance(st.value.value, ast.Name):
                    copied = copies.get(st.value.value.id)
                    cast = next((c for c in casts if copied and copied[0] < c[0] < st.lineno and c[1] in copied[1]), None)
                    if cast is not None:
                        self.report(st, f"`{st.value.value.id}` was copied from the weights at line {copied[0]}, "
                                        f"before `{cast[1]}` was cast to `{cast[2]}` at line {cast[0]}: the write "
                                        "puts the float32 copy into the cast weights")
        return self.hits


def _self_attrs(nodes) -> set[str]:
    return {n.attr for node in nodes for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}


class CacheKeyedWithoutDtype(RuleVisitor):
    """AMP021 for a cache: tables made from a buffer (``emb = t * self.inv_freq``) and kept in
    plain attributes (``self._cos_cached = emb.cos()``), rebuilt when ``if`` the length or the
    device changes but not the dtype. ``model.half()`` casts buffers and parameters, not plain
    attributes, so tables built before the cast stay float32 and meet half activations (and
    promote them: xformers' rotary embedding until 2022)."""

    def run(self):
        ctx = self.ctx
        for cls in classes_calling(ctx, "register_buffer"):
            buffers = set(registered_buffers(cls))
            if not buffers:
                continue
            for test_if in (n for n in ast.walk(cls) if isinstance(n, ast.If)):
                test = test_if.test
                mentions = {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)}
                keyed = _self_attrs([test])
                if "device" not in mentions or "dtype" in mentions or not keyed:
                    continue
                cached = sorted(t.attr for st in test_if.body for n in ast.walk(st)
                                if isinstance(n, ast.Assign) and any(isinstance(c, ast.Call) for c in ast.walk(n.value))
                                for tgt in n.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])
                                if isinstance(t, ast.Attribute) and dotted(t.value) == "self"
                                and t.attr not in buffers and t.attr in keyed)
                if cached and _self_attrs(test_if.body) & buffers:
                    confidence, why = _confidence(ctx)
                    self.report(test, f"`self.{cached[0]}` is rebuilt when the length or the device changes, not "
                                      "the dtype: a plain attribute, which a model cast leaves as it was, so tables "
                                      f"made before `model.half()` stay float32 beside half activations{why}",
                                confidence)
        return self.hits


RULES: tuple[Rule, ...] = (Float32BesideActivations.rule,)
