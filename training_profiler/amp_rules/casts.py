"""Casts that bypass autocast: a manual ``.half()`` / ``.to(torch.bfloat16)`` of what trains
(AMP001), and a float16 cast on the path that selected bfloat16."""
from __future__ import annotations

import ast

from training_profiler import amp_values as av
from training_profiler.amp_context import FileContext, dotted
from training_profiler.amp_intent import receiver_root, training_lowp_casts
from training_profiler.amp_rules.base import Rule, RuleVisitor, Severity, declare_rule
from training_profiler.amp_rules.helpers import _selects_bf16

_FLOAT16 = ("torch.float16", "torch.half")  # a float16 literal, as the code writes it


@declare_rule(
    "AMP001", "manual-cast", Severity.HIGH,
    explanation=(
        "A manual cast to float16/bfloat16 in AMP code bypasses autocast's per-op precision "
        "choice (ops autocast would keep in float32 now run in low precision)."),
    suggestion="Remove the cast and let `with torch.autocast(...)` choose; keep master weights in float32.")
class ManualCast(RuleVisitor):
    """Training casts in AMP code, and float16 casts on a path that selected bfloat16 (wherever
    they are: float16 cannot hold what the bfloat16 path was chosen for)."""

    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        d = ctx.lowp_cast_dtype(node)
        if d:
            attr = node.func.attr
            what = f".{attr}()" if attr in ("half", "bfloat16") else f".{attr}({d})"
            bf16_if = next((a for a in ctx.parents_chain(node) if isinstance(a, ast.If)
                            and _selects_bf16(ctx, a.test) and _in_body(a, node)), None)
            literal = attr == "half" or any(ctx.qualname(a) in _FLOAT16 for a in
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
                    out.add(dotted(n.func.value).split(".")[0])
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



class Float16ChosenOnBf16Path(RuleVisitor):
    """AMP001 for a dtype chosen, not cast: ``torch.float16`` as the value an ``if``/``else``
    expression or an ``if`` body picks when its test says bfloat16 was asked for
    (``torch.float16 if cfg.fp16 or cfg.bf16 else torch.float32``: axolotl until 2023).
    Whatever it is handed to (``torch_dtype=``, ``.to(dtype)``) then runs a bfloat16 model in
    float16, whose range (65504) bfloat16 models are not trained to stay in."""

    def run(self):
        ctx = self.ctx
        for node in ctx.nodes:
            if isinstance(node, ast.IfExp) and self._float16(node.body) and _selects_bf16(ctx, node.test):
                self._hit(node.body, node.test)
            elif isinstance(node, ast.If) and _selects_bf16(ctx, node.test):
                for st in node.body:
                    values = [st.value] if isinstance(st, (ast.Assign, ast.AnnAssign, ast.Return)) and st.value else []
                    values += [k.value for c in ast.walk(st) if isinstance(c, ast.Call) and not ctx.lowp_cast_dtype(c)
                               for k in c.keywords if k.arg in ("dtype", "torch_dtype")]
                    for v in values:
                        if self._float16(v):
                            self._hit(v, node.test)
        return self.hits

    def _float16(self, node: ast.AST) -> bool:
        return isinstance(node, (ast.Attribute, ast.Name)) and self.ctx.qualname(node) in _FLOAT16

    def _hit(self, node: ast.AST, test: ast.AST) -> None:
        self.report(node, f"float16 chosen on the bfloat16 path (`{ast.unparse(test)[:60]}`): a bfloat16 model "
                          "run in float16 can pass its range (65504)")


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (ManualCast.rule,)
