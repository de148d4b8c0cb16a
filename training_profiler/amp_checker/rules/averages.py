"""AMP025: a moving average of the parameters kept in their own dtype, in a float16 model.

An exponential moving average blends ``(1 - decay) * p`` into the average each step; with decay
0.999 that term is a thousandth of the average, under float16's resolution (2**-10 relative), so
a float16 average stops moving. Trainers that cast their model with ``model.half()`` and copy
its parameters for the average (``[p.detach() for p in model.parameters()]``) keep it in
float16 (OpenNMT-py until 2019, fixed by a float32 copy).
"""
from __future__ import annotations

import ast
import re

from quant.vocabulary import FLOAT16, Severity
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import TRAINING, cast_purpose, per_project, receiver_root
from training_profiler.amp_checker.precision import lowp_parameters
from training_profiler.amp_checker.rules.base import Rule, RuleVisitor, declare_rule

_AVERAGE = re.compile(r"avg|average|ema|shadow|swa", re.I)
_MODEL = re.compile(r"model|net|module", re.I)
_COPIES = {"detach", "clone", "data"}


@per_project
def float16_model_cast(ctx: FileContext) -> tuple[FileContext, ast.Call] | None:
    """Where the project casts a model (not a tensor) to float16 for training: ``model.half()``
    as a statement of its own (in place: only a module casts in place), or assigned back to a
    name that says model. The first such cast, with its module."""
    return next(((m, c) for m in ctx.project.program_modules(ctx) for c in m.manual_lowp_casts
                 if m.lowp_cast_dtype(c) == FLOAT16 and cast_purpose(m, c) == TRAINING and _casts_a_model(m, c)),
                None)


def _casts_a_model(ctx: FileContext, call: ast.Call) -> bool:
    parent = ctx.parents.get(call)
    root = dotted(receiver_root(call)) or ""
    if isinstance(parent, ast.Expr):
        return True
    return isinstance(parent, ast.Assign) and bool(_MODEL.search(root.rsplit(".", 1)[-1]))


def _parameter_copy(comp: ast.AST) -> bool:
    """``[p.detach() for p in m.parameters()]`` / ``{n: p.clone() for n, p in m.named_parameters()}``,
    with no float32 cast in the element."""
    if not isinstance(comp, (ast.ListComp, ast.DictComp, ast.GeneratorExp)) or len(comp.generators) != 1:
        return False
    it = comp.generators[0].iter
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute)
            and it.func.attr in ("parameters", "named_parameters")):
        return False
    elt = comp.value if isinstance(comp, ast.DictComp) else comp.elt
    attrs = []
    cur = elt
    while isinstance(cur, (ast.Call, ast.Attribute)):
        if isinstance(cur, ast.Call):
            cur = cur.func
            continue
        attrs.append(cur.attr)
        cur = cur.value
    return bool(attrs) and set(attrs) <= _COPIES and isinstance(cur, ast.Name)


@declare_rule(
    "AMP025", "average-in-parameter-dtype", Severity.MEDIUM, training_path=True,
    explanation=("A moving average of the parameters copied in their own dtype lives in float16 when the model "
                 "is cast to float16: each step adds (1 - decay) of the parameters, under float16's relative "
                 "resolution (2**-10) for a decay of 0.999, so the average stops moving."),
    suggestion=("Keep the average in float32 (`p.detach().float()`), and cast it to the model's dtype only when "
                "loading it into the model."))
class AverageInParameterDtype(RuleVisitor):
    """``copy_params = [p.detach() for p in self.model.parameters()]`` bound to a name that says
    average (or assigned to one), in a project that casts its model to float16 for training."""

    def visit_Assign(self, node: ast.Assign) -> None:
        ctx = self.ctx
        if _parameter_copy(node.value):
            names = [dotted(t) or "" for t in node.targets]
            fn = ctx.enclosing_function(node)
            aliases = [dotted(t) or "" for st in ast.walk(fn) if isinstance(st, ast.Assign)
                       and isinstance(st.value, ast.Name) and st.value.id in names for t in st.targets]
            average = next((n for n in names + aliases if _AVERAGE.search(n.rsplit(".", 1)[-1])), None)
            where = float16_model_cast(ctx) if average else None
            if where is not None or (average and lowp_parameters(ctx)):
                at = (f" ({where[0].path.rsplit('/', 1)[-1]}:{where[1].lineno})" if where else "")
                self.report(node.value, f"`{average}` copies the parameters in their own dtype, and the model is "
                                        f"cast to float16{at}: the average lives in float16")
        self.generic_visit(node)


_IN_PLACE_UPDATES = {"mul_", "lerp_", "add_", "sub_", "copy_", "addcmul_"}


def _deepcopy_call(node: ast.AST, ctx: FileContext) -> bool:
    return isinstance(node, ast.Call) and (ctx.qualname(node.func) or "").endswith("deepcopy")


def _copied_average(ctx: FileContext, cls: ast.ClassDef) -> dict[str, ast.AST]:
    """``self.<average> = deepcopy(...)`` (also ``deepcopy(...).eval()`` / ``.half()``) in a class:
    attribute name -> the assignment's value."""
    out: dict[str, ast.AST] = {}
    for st in ast.walk(cls):
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Attribute)):
            continue
        cur = st.value
        while isinstance(cur, ast.Call) and isinstance(cur.func, ast.Attribute) and not _deepcopy_call(cur, ctx):
            cur = cur.func.value
        name = st.targets[0].attr
        if _deepcopy_call(cur, ctx) and _AVERAGE.search(name) and dotted(st.targets[0].value) == "self":
            out.setdefault(name, st.value)
    return out


def _updates_in_place(cls: ast.ClassDef) -> bool:
    """The class blends into its copy in place (``v *= d``, ``v.mul_(d)``, ``e.lerp_(p, w)``)."""
    return any((isinstance(n, ast.AugAssign) and isinstance(n.op, (ast.Mult, ast.Add, ast.Sub)))
               or (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _IN_PLACE_UPDATES)
               for n in ast.walk(cls))


class AverageCopyCastToLowp(RuleVisitor):
    """AMP025 for a copied model: ``self.ema = deepcopy(model).half()`` (or ``self.ema.half()``
    later) in a class that updates its copy in place, so the average lives in half precision
    (yolov5 until 2020; bfloat16 is coarser still, 2**-7 relative)."""

    def run(self):
        ctx = self.ctx
        classes: dict[int, ast.ClassDef] = {}
        for c in ctx.calls:
            if _deepcopy_call(c, ctx) and (cls := ctx.values.enclosing_class(c)) is not None:
                classes.setdefault(id(cls), cls)
        for cls in sorted(classes.values(), key=lambda n: n.lineno):
            copies = _copied_average(ctx, cls)
            if copies and _updates_in_place(cls):
                for call in (n for n in ast.walk(cls) if isinstance(n, ast.Call)):
                    dtype = ctx.lowp_cast_dtype(call)
                    name = _average_cast(ctx, call, copies) if dtype else None
                    if name:
                        self.report(call, f"the moving average `self.{name}` is a copy of the model cast to {dtype}: "
                                          "its small per-step updates are rounded away")
        return self.hits


def _average_cast(ctx: FileContext, call: ast.Call, copies: dict[str, ast.AST]) -> str | None:
    """The average a cast applies to: ``self.<name>.half()``, or the cast inside the copy's own
    assignment (``deepcopy(model).half()``)."""
    root = call.func.value
    while isinstance(root, ast.Call) and isinstance(root.func, ast.Attribute) and not _deepcopy_call(root, ctx):
        root = root.func.value
    return next((n for n, v in copies.items()
                 if dotted(root) == f"self.{n}" or (_deepcopy_call(root, ctx) and _within(v, root))), None)


def _within(tree: ast.AST, node: ast.AST) -> bool:
    return any(n is node for n in ast.walk(tree))


RULES: tuple[Rule, ...] = (AverageInParameterDtype.rule,)
