"""What a piece of code is for: training, or something that only looks like it.

Real training files also save half-precision checkpoints, evaluate a ``.half()`` copy, round
values through float16 (``x.half().float()``), run frozen encoders in float16, profile a backward
pass, and keep a plain ``loss.backward()`` for the non-AMP configuration. The rules ask here before
calling a cast or a backward part of mixed-precision training, and each answer is judged from what
the code does (calls, context managers, ``requires_grad_``), not from how things are named.
"""
from __future__ import annotations

import ast
import functools

from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.context import FileContext, dotted

TRAINING = "training"
ROUND_TRIP = "round-trip"        # x.half().float(): rounding values, the result is float32
CHECKPOINT = "checkpoint"        # a copy being saved (torch.save, state_dict comprehension, deepcopy)
EVALUATION = "evaluation"        # under no_grad / inference_mode, or in a function that evaluates
FROZEN = "frozen"                # a module whose parameters do not train (requires_grad_(False))
MATCHING = "matching"            # `avg.half() if param.dtype == torch.float16 else avg`: follows a tested dtype

_NO_GRAD = {"torch.no_grad", "torch.inference_mode", "torch.autograd.grad_mode.no_grad",
            "torch.autograd.grad_mode.inference_mode"}
_FLOAT32_CASTS = {"float", "double"}
_SAVE_CALLS = ("save", "save_file", "save_checkpoint", "save_model", "save_pretrained", "save_state")
_PROFILERS = {"torch.profiler.profile", "torch.autograd.profiler.profile",
              "torch.autograd.profiler.record_function", "torch.profiler.record_function",
              "torch.utils.benchmark.Timer"}


def is_float32_cast(ctx: FileContext, call: ast.AST) -> bool:
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
        return False
    if call.func.attr in _FLOAT32_CASTS and not call.args:
        return True
    if call.func.attr in ("to", "type"):
        return any(ctx.dtype_of(a) in ("float32", "float64") for a in
                   [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")])
    return False


def float32_result(ctx: FileContext, expr: ast.AST) -> bool:
    """The value is float32 whatever its inputs were: a float32 cast (``x.float()``,
    ``x.to(torch.float32)``) or an op given ``dtype=torch.float32`` (softmax, sum, mean, ...),
    so later rules must not treat it as a low-precision result of autocast."""
    if is_float32_cast(ctx, expr):
        return True
    return isinstance(expr, ast.Call) and any(
        k.arg == "dtype" and ctx.dtype_of(k.value) in ("float32", "float64") for k in expr.keywords)


def no_grad_region(ctx: FileContext, node: ast.AST) -> bool:
    """Inside ``with torch.no_grad()`` / ``inference_mode()`` or a function decorated so."""
    for a in ctx.parents_chain(node):
        if isinstance(a, (ast.With, ast.AsyncWith)) and any(
                (ctx.call_name(i.context_expr) if isinstance(i.context_expr, ast.Call)
                 else ctx.qualname(i.context_expr)) in _NO_GRAD for i in a.items):
            return True
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                (ctx.qualname(d.func if isinstance(d, ast.Call) else d) or "") in _NO_GRAD
                for d in a.decorator_list):
            return True
    return False


def _calls_in(fn: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call)]


def _method_calls(fn: ast.AST, attr: str) -> list[ast.Call]:
    return [c for c in _calls_in(fn) if isinstance(c.func, ast.Attribute) and c.func.attr == attr]


def _frozen_receivers(ctx: FileContext, where: ast.AST) -> set[str]:
    """Modules made not to train: ``m.requires_grad_(False)`` or ``for p in m.parameters():
    p.requires_grad = False``, in ``where`` (a function) for local names, anywhere in the
    file for attributes (``self.vae``)."""
    frozen: set[str] = set()
    for scope in {id(where): where, id(ctx.tree): ctx.tree}.values():
        local = scope is where
        for c in _method_calls(scope, "add_adapter"):  # PEFT freezes the base weights it adapts
            r = dotted(c.func.value)
            if r and (local or "." in r):
                frozen.add(r)
        for c in _method_calls(scope, "requires_grad_"):
            arg = c.args[0] if c.args else next((k.value for k in c.keywords if k.arg == "requires_grad"), None)
            r = dotted(c.func.value)
            if isinstance(arg, ast.Constant) and arg.value is False and r and (local or "." in r):
                frozen.add(r)
        for loop in (n for n in ast.walk(scope) if isinstance(n, ast.For)):
            it = loop.iter
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in (
                    "parameters", "named_parameters"):
                r = dotted(it.func.value)
                if not r or not (local or "." in r):
                    continue
                for st in ast.walk(loop):
                    if (isinstance(st, ast.Assign) and isinstance(st.value, ast.Constant) and st.value.value is False
                            and any(isinstance(t, ast.Attribute) and t.attr == "requires_grad" for t in st.targets)):
                        frozen.add(r)
    return frozen


def receiver_root(call: ast.Call) -> ast.AST:
    """``a.b.to(...).half()`` -> ``a.b``: the object the chain of calls starts from."""
    cur: ast.AST = call.func.value if isinstance(call.func, ast.Attribute) else call
    while isinstance(cur, ast.Call) and isinstance(cur.func, ast.Attribute):
        cur = cur.func.value
    return cur


def _in_call_named(ctx: FileContext, node: ast.AST, names: tuple[str, ...]) -> bool:
    """``node`` sits (within its statement) inside a call whose last name is one of ``names``."""
    for a in ctx.parents_chain(node):
        if isinstance(a, ast.stmt):
            return False
        if isinstance(a, ast.Call) and (ctx.call_name(a) or "").rsplit(".", 1)[-1] in names:
            return True
    return False


def _in_save(ctx: FileContext, node: ast.AST) -> bool:
    """A checkpoint copy: inside a save or deepcopy call, a comprehension over a state_dict, a
    chain through ``state_dict()`` or ``deepcopy(...)``, or bound to a name that is only saved."""
    if _in_call_named(ctx, node, (*_SAVE_CALLS, "deepcopy")):
        return True
    for a in ctx.parents_chain(node):
        if isinstance(a, ast.stmt):
            break
        if isinstance(a, (ast.DictComp, ast.ListComp, ast.GeneratorExp)) and any(
                isinstance(n, ast.Attribute) and n.attr == "state_dict"
                for gen in a.generators for n in ast.walk(gen.iter)):
            return True
    root = receiver_root(node) if isinstance(node, ast.Call) else None
    if isinstance(root, ast.Call) and (ctx.call_name(root) or "").rsplit(".", 1)[-1] == "deepcopy":
        return True
    chain = node
    while isinstance(chain, ast.Call) and isinstance(chain.func, ast.Attribute):
        if chain.func.attr == "state_dict":
            return True
        chain = chain.func.value
    stmt = next((a for a in ctx.parents_chain(node) if isinstance(a, ast.stmt)), None)
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        name = stmt.targets[0].id
        fn = ctx.enclosing_function(node)
        uses = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
        if uses and all(_in_call_named(ctx, u, _SAVE_CALLS) for u in uses):
            return True
    return False


def _argument_of_evaluator(ctx: FileContext, node: ast.AST) -> bool:
    """The cast's result goes straight into a project function that runs without gradients
    (decorated with no_grad / inference_mode or a wrapper of them): an evaluation copy."""
    for a in ctx.parents_chain(node):
        if isinstance(a, ast.stmt):
            return False
        if isinstance(a, ast.Call) and node is not a.func:
            for v in ctx.values.value(a.func):
                if v.kind == av.FUNCTION and any(
                        (dotted(d.func if isinstance(d, ast.Call) else d) or "").endswith(("no_grad", "inference_mode"))
                        for d in getattr(v.node, "decorator_list", [])):
                    return True
    return False


def has_backward(fn: ast.AST) -> bool:
    return bool(_method_calls(fn, "backward")) or any(
        (isinstance(c.func, ast.Attribute) and c.func.attr == "grad") for c in _calls_in(fn))


def cast_purpose(ctx: FileContext, call: ast.Call) -> str:
    """Why this low-precision cast is there: TRAINING unless the code shows another purpose."""
    parent = ctx.parents.get(call)
    if isinstance(parent, ast.Attribute) and is_float32_cast(ctx, ctx.parents.get(parent)):
        return ROUND_TRIP
    if _in_save(ctx, call):
        return CHECKPOINT
    if _matches_tested_dtype(ctx, call):
        return MATCHING
    if no_grad_region(ctx, call) or _argument_of_evaluator(ctx, call):
        return EVALUATION
    fn = ctx.enclosing_function(call)
    if fn is not ctx.tree and not has_backward(fn) and _method_calls(fn, "eval") and not _method_calls(fn, "train"):
        return EVALUATION
    root = dotted(receiver_root(call)) or ""
    frozen = _frozen_receivers(ctx, fn)
    if root and (root in frozen or any(root.startswith(f + ".") for f in frozen)):
        return FROZEN
    if root and _frozen_on_branch(ctx, call, root, fn):
        return FROZEN
    # the cast result bound to a name that is then frozen
    stmt = next((a for a in ctx.parents_chain(call) if isinstance(a, ast.stmt)), None)
    if isinstance(stmt, ast.Assign) and any(dotted(t) in frozen for t in stmt.targets):
        return FROZEN
    return TRAINING


def _frozen_on_branch(ctx: FileContext, call: ast.Call, root: str, fn: ast.AST) -> bool:
    """The cast sits on the branch where the module's gradients were switched off by a flag:
    ``m.requires_grad_(train_m)`` and then ``if not train_m: m.to(dtype=weight_dtype)``
    (the ``else`` of ``if train_m:`` too). On that branch ``requires_grad_`` got a false
    value, so nothing of ``m`` trains whatever the flag is at run time."""
    flags = {c.args[0].id for c in _method_calls(fn, "requires_grad_")
             if dotted(c.func.value) == root and len(c.args) == 1 and isinstance(c.args[0], ast.Name)}
    if not flags:
        return False
    child: ast.AST = call
    for a in ctx.parents_chain(call):
        if a is fn:
            return False
        if isinstance(a, ast.If):
            test = a.test
            negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
            name = test.operand if negated else test
            if isinstance(name, ast.Name) and name.id in flags and (
                    (negated and child in a.body) or (not negated and child in a.orelse)):
                return True
        child = a
    return False


def _matches_tested_dtype(ctx: FileContext, call: ast.Call) -> bool:
    """The cast is written into a tensor the code has just tested to have this dtype
    (``p.data = avg.half() if p.dtype == torch.float16 else avg``): it follows the precision of
    the tensor it loads, it does not choose one. A copy kept elsewhere in the tested dtype
    (``ema = p.detach().half() if p.dtype == torch.float16 else ...``) is not: that keeps state
    in half precision."""
    want = ctx.lowp_cast_dtype(call)
    stmt = next((a for a in ctx.parents_chain(call) if isinstance(a, ast.stmt)), None)
    loaded = {_base_name(t) for t in getattr(stmt, "targets", [])} - {None}
    child: ast.AST = call
    for a in ctx.parents_chain(call):
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return False
        in_body = (isinstance(a, ast.IfExp) and child is a.body) or (isinstance(a, ast.If) and child in a.body)
        if in_body and any(isinstance(t, ast.Compare) and isinstance(t.left, ast.Attribute) and t.left.attr == "dtype"
                           and _base_name(t.left) in loaded
                           and any(isinstance(op, (ast.Eq, ast.Is, ast.In)) for op in t.ops)
                           and want in compared_dtypes(ctx, t)
                           for t in ast.walk(a.test)):
            return True
        child = a
    return False


def compared_dtypes(ctx: FileContext, test: ast.Compare) -> set[str]:
    """The dtypes a comparison names on its right (``== torch.float16``, ``in (torch.float16,
    torch.bfloat16)``): what a ``x.dtype`` test checks for."""
    out: set[str] = set()
    for c in test.comparators:
        for e in c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]:
            d = ctx.dtype_of(e)
            if d and d != "unknown":
                out.add(d)
    return out


def _base_name(expr: ast.AST) -> str | None:
    """``param.data[0]`` -> ``param``: the name an attribute / index / call chain starts from."""
    while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def profiling_region(ctx: FileContext, node: ast.AST) -> bool:
    """Under a torch profiler / benchmark context, or in a function that such code calls only."""
    for a in ctx.parents_chain(node):
        if isinstance(a, (ast.With, ast.AsyncWith)) and any(
                (ctx.call_name(i.context_expr) if isinstance(i.context_expr, ast.Call) else "") in _PROFILERS
                for i in a.items):
            return True
    return False


def optimizer_steps(ctx: FileContext, fn: ast.AST) -> list[ast.Call]:
    """``x.step(...)`` calls that update parameters: on an optimizer or a GradScaler, or on an
    object whose value is not known to be something else (an LR scheduler is not an update)."""
    out = []
    for c in _method_calls(fn, "step"):
        kinds = ctx.values.kinds(c.func.value)
        q = ctx.qualname(c.func.value) or ""
        if "lr_scheduler" in q:
            continue
        if not kinds or kinds & {av.OPTIMIZER, av.SCALER, av.PARAM, av.EXTERNAL, av.INSTANCE}:
            out.append(c)
    return out


def training_backward_calls(ctx: FileContext) -> list[ast.Call]:
    """``loss.backward()`` calls that are part of training: not a kernel module's
    ``backward(...)`` (receiver is an imported name), not inside an autograd Function's own
    backward, not under a profiler, and in a function (or module) that also updates parameters
    or is called by one that does."""
    out = []
    for n in ctx.calls:
        if not (isinstance(n.func, ast.Attribute) and n.func.attr == "backward"):
            continue
        head = (dotted(n.func.value) or "").split(".")[0]
        fn = ctx.enclosing_function(n)
        if head in ctx.aliases or getattr(fn, "name", None) == "backward":
            continue
        if profiling_region(ctx, n) or (fn is not ctx.tree and _times_itself(ctx, fn)
                                         and not optimizer_steps(ctx, fn)):
            continue
        if fn is ctx.tree or optimizer_steps(ctx, fn) or _caller_steps(ctx, fn):
            out.append(n)
    return out


_TIMERS = {"time.time", "time.perf_counter", "time.monotonic", "torch.cuda.synchronize",
           "torch.cuda.Event", "timeit.default_timer"}


def _times_itself(ctx: FileContext, fn: ast.AST) -> bool:
    """A function that reads clocks or CUDA events around its work: a profiling helper."""
    return any((ctx.call_name(c) or "") in _TIMERS or (isinstance(c.func, ast.Attribute)
               and c.func.attr == "elapsed_time") for c in _calls_in(fn))


def _caller_steps(ctx: FileContext, fn: ast.AST) -> bool:
    """A training step split in two: the function that calls backward, called by one that steps."""
    for call, cctx in ctx.project.calls_to(fn, ctx):
        caller = cctx.enclosing_function(call)
        if optimizer_steps(cctx, caller) and not profiling_region(cctx, call):
            return True
    return not ctx.project.calls_to(fn, ctx)  # nobody in the tree calls it: a public step API


def amp_evidence(ctx: FileContext, nodes: list[ast.AST]) -> bool:
    """Whether these statements use loss scaling or open autocast."""
    scaler = set(map(id, ctx.scaler_calls))
    for stmt in nodes:
        for n in ast.walk(stmt):
            if id(n) in scaler:
                return True
            if isinstance(n, (ast.With, ast.AsyncWith)) and any(ctx.with_scope(i.context_expr) for i in n.items):
                return True
    return False


def on_non_amp_branch(ctx: FileContext, node: ast.AST) -> bool:
    """``if use_amp: scaler.scale(loss).backward() else: loss.backward()``: the ``else`` is the
    non-AMP configuration. A node is on it when an enclosing ``if`` has AMP on the other branch
    and none on the node's own."""
    child = node
    for a in ctx.parents_chain(node):
        if isinstance(a, ast.If) and child is not a.test:
            mine, other = (a.body, a.orelse) if child in a.body else (a.orelse, a.body)
            if other and amp_evidence(ctx, other) and not amp_evidence(ctx, mine):
                return True
        child = a
    return False


# ---- casts the training makes ------------------------------------------------------------
def per_module(fn):
    """Cache a module-wide fact in the module's ``facts``: the rules ask it once per node."""
    key = "_fact_" + fn.__name__

    @functools.wraps(fn)
    def cached(ctx: FileContext):
        if key not in ctx.facts:
            ctx.facts[key] = fn(ctx)
        return ctx.facts[key]
    return cached


def per_project(fn):
    """Cache a program-wide fact in the project's ``facts``, once per program of the scan
    (``Project.program_key``): every module of a program gets the one answer, and a module of
    another repository scanned beside it gets its own."""
    name = "_fact_" + fn.__name__

    @functools.wraps(fn)
    def cached(ctx: FileContext):
        facts, key = ctx.project.facts, (name, ctx.project.program_key(ctx))
        if key not in facts:
            facts[key] = fn(ctx)
        return facts[key]
    return cached


def trains(ctx: FileContext) -> bool:
    """The module runs a training step (a backward that updates parameters, or loss scaling);
    an inference pipeline or an export script does not, so its casts are not training casts."""
    return bool(training_backward_calls(ctx) or ctx.scaler_calls)


@per_module
def training_lowp_casts(ctx: FileContext) -> list[ast.Call]:
    """Manual low-precision casts whose purpose is training (not a checkpoint copy, an
    evaluation model, a round trip or a frozen module) in a module that trains, off any
    non-AMP branch."""
    return [c for c in ctx.manual_lowp_casts if trains(ctx)
            and cast_purpose(ctx, c) == TRAINING and not on_non_amp_branch(ctx, c)]


# ---- what a file does: a training program, or one that only runs or times a model ----------
INFERENCE = "inference"          # a script that never steps: inference, export, evaluation
BENCHMARK = "benchmark"          # a script whose every step is timed and that keeps nothing
_FIT_CALLS = ("fit", "train", "train_batch", "train_step", "training_step")  # a library trains


def step_built(ctx: FileContext) -> bool:
    """A ``.backward(`` call (not an autograd Function's own backward, not a kernel module's),
    or an optimizer or GradScaler built, anywhere in the module."""
    for c in ctx.calls:
        q = ctx.call_name(c) or ""
        if q.startswith("torch.optim.") and ".lr_scheduler" not in q or q.endswith("GradScaler"):
            return True
        if isinstance(c.func, ast.Attribute) and c.func.attr == "backward" \
                and (dotted(c.func.value) or "").split(".")[0] not in ctx.aliases \
                and getattr(ctx.enclosing_function(c), "name", None) != "backward":
            return True
    return False


@per_module
def steps_seen(ctx: FileContext) -> bool:
    """Anything in the module that takes a training step or builds what takes one: a training
    backward or loss scaling (``trains``), ``step_built``, an optimizer by value, or a library
    told to train (``trainer.fit(model)``, ``trainer.train()``, ``model.train()``). Precision
    alone says nothing: an inference script opens autocast too."""
    if trains(ctx) or ctx.scaler_calls or step_built(ctx):
        return True
    return any((c.func.attr if isinstance(c.func, ast.Attribute) else (ctx.call_name(c) or "").rsplit(".", 1)[-1])
               in _FIT_CALLS or av.OPTIMIZER in ctx.values.kinds(c) for c in ctx.calls)


def _runs_as_script(ctx: FileContext) -> bool:
    """The module is run, not imported: an ``if __name__ == "__main__"`` block, or a loop at
    module level (also inside a module-level ``with`` or ``if``: a sampling script's
    ``with torch.no_grad(): for ...``). A snippet of statements without a loop is not judged."""
    todo = list(ctx.tree.body)
    while todo:
        st = todo.pop()
        if isinstance(st, (ast.For, ast.While, ast.AsyncFor)):
            return True
        if isinstance(st, ast.If) and any(isinstance(n, ast.Constant) and n.value == "__main__"
                                          for n in ast.walk(st.test)):
            return True
        if isinstance(st, (ast.With, ast.AsyncWith, ast.If, ast.Try)):
            todo += [*st.body, *getattr(st, "orelse", []), *getattr(st, "finalbody", [])]
    return False


def _keeps_result(ctx: FileContext) -> bool:
    """The module saves something (a checkpoint, a model, a state dict): what it trains outlives
    the run."""
    return any((ctx.call_name(c) or "").rsplit(".", 1)[-1] in _SAVE_CALLS
               or (isinstance(c.func, ast.Attribute) and c.func.attr in (*_SAVE_CALLS, "state_dict"))
               for c in ctx.calls)


_DEVICE_TIMERS = {"torch.cuda.synchronize", "torch.cuda.Event", "torch.utils.benchmark.Timer",
                  "timeit.timeit", "timeit.Timer", "timeit.repeat"}


def _device_timed(ctx: FileContext, fn: ast.AST) -> bool:
    """``fn`` times device work the way a benchmark does (a device synchronize or CUDA events,
    ``torch.utils.benchmark``, ``timeit``) or runs under a profiler; a trainer's wall-clock
    reads for a log line (``time.perf_counter()`` alone) do not count."""
    return any((ctx.call_name(c) or "") in _DEVICE_TIMERS or (isinstance(c.func, ast.Attribute)
               and c.func.attr == "elapsed_time") for c in _calls_in(fn))


def _only_timed_steps(ctx: FileContext) -> bool:
    """Every ``.backward(`` of the module sits in code that times the device (``_device_timed``
    of its function, of every caller of it, or of the script's top level) or runs under a
    profiler, and the module keeps nothing: a benchmark measures the step, it trains no model."""
    backward = [c for c in ctx.calls if isinstance(c.func, ast.Attribute) and c.func.attr == "backward"]
    return bool(backward) and not _keeps_result(ctx) and all(
        profiling_region(ctx, c) or _timed(ctx, ctx.enclosing_function(c)) for c in backward)


def _timed(ctx: FileContext, fn: ast.AST) -> bool:
    """``fn`` times the device itself, or every call of it does (``sync(); t0 = ...; step()``)."""
    if _device_timed(ctx, fn):
        return True
    calls = ctx.project.calls_to(fn, ctx) if fn is not ctx.tree else []
    return bool(calls) and all(profiling_region(cc, call) or _device_timed(cc, cc.enclosing_function(call))
                               for call, cc in calls)


def _defines_model(ctx: FileContext) -> bool:
    """A class with a ``forward`` (a module, an autograd Function): library code that training
    elsewhere may run, whatever its own demo block does."""
    return any(isinstance(n, ast.ClassDef) and any(isinstance(b, ast.FunctionDef) and b.name == "forward"
                                                   for b in n.body) for n in ctx.tree.body)


@per_module
def program_purpose(ctx: FileContext) -> str | None:
    """What this file does when it is not a training program: INFERENCE for a script that never
    takes a training step (inference, export, evaluation), BENCHMARK for one whose every step is
    timed and that saves nothing; None otherwise (it trains, or it is library code whose users
    decide). Judged from what the code calls, never from names: the script is run (not imported
    by the scan) and defines no model or Function (``_defines_model``), and neither it nor a
    project module it imports takes a training step (a ``main.py`` that calls
    ``engine.train_one_epoch`` trains)."""
    if not _runs_as_script(ctx) or _defines_model(ctx):
        return None
    imported, importers = ctx.project.imports_and_importers(ctx)
    if importers or any(steps_seen(m) for m in imported):
        return None
    if not steps_seen(ctx):
        return INFERENCE
    return BENCHMARK if _only_timed_steps(ctx) else None
