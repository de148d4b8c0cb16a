"""Casts that bypass autocast: a manual ``.half()`` / ``.to(torch.bfloat16)`` of what trains
(AMP001), and a float16 cast on the path that selected bfloat16."""
from __future__ import annotations

import ast
import re

from quant.vocabulary import FLOAT16, Severity
from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import per_module, receiver_root, training_lowp_casts
from training_profiler.amp_checker.rules.base import Confidence, Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import (
    _BF16_WORDS,
    _selects_bf16,
    in_parameter,
    test_module,
)


@declare_rule(
    "AMP001", "manual-cast", Severity.HIGH, training_path=True,
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
            literal = _literal_float16(ctx, node)
            if d == "float16" and literal and bf16_if is not None:
                self.report(node, f"{what} on the bfloat16 path (`{ast.unparse(bf16_if.test)[:60]}`)")
            elif ctx.uses_amp and node in training_lowp_casts(ctx):
                note = _runtime_dtype_note(ctx, node)
                held = "" if note else _held_instead(ctx, node)
                if held:
                    self.report(node, f"{what} call detected (the optimizer built beside it holds {held}, "
                                      "not this module: it may be a frozen part)", Confidence.LOW)
                elif not note or _module_like(ctx, node):
                    self.report(node, f"{what} call detected{note}")
        self.generic_visit(node)


_MODULE_METHODS = {"parameters", "named_parameters", "eval", "train", "requires_grad_", "state_dict",
                   "load_state_dict", "modules", "children", "set_progress_bar_config", "register_buffer"}


def _module_receiver(ctx: FileContext, call: ast.Call) -> str | None:
    """The cast's receiver when it is used as a module (its parameters, train/eval,
    state_dict...) in the same function; None for anything else (a batch, an activation)."""
    name = dotted(receiver_root(call))
    if not name:
        return None
    fn = ctx.enclosing_function(call)
    return name if any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in _MODULE_METHODS
                       and dotted(c.func.value) == name for c in ast.walk(fn)) else None


def _module_like(ctx: FileContext, call: ast.Call) -> bool:
    """The cast's receiver is a module that trains (or nothing says otherwise): a run-time
    dtype cast of a batch or an activation to match a frozen model
    (``batch["pixel_values"].to(dtype=weight_dtype)``) is data plumbing, not a cast of trained
    weights."""
    name = _module_receiver(ctx, call)
    if not name:
        return False
    trained = _optimized_modules(ctx, ctx.enclosing_function(call))
    return trained is None or name.split(".")[0] in trained


def _held_instead(ctx: FileContext, call: ast.Call) -> str:
    """The modules the optimizer built in the cast's function holds, as text, when the cast
    module is not one of them (``unet.to(torch.float16)`` beside
    ``Adam(control_net.prepare_optimizer_params())``); '' when it is, when no optimizer is
    built there, or when what it holds is not known. Not proof that the module is frozen (a
    wrapper may hold it), so such a finding is low confidence."""
    name = _module_receiver(ctx, call)
    if not name:
        return ""
    held = _optimized_modules(ctx, ctx.enclosing_function(call), any_method=True)
    if not held or name.split(".")[0] in held:
        return ""
    return ", ".join(f"`{h}`" for h in sorted(held))


def _optimized_modules(ctx: FileContext, fn: ast.AST, any_method: bool = False) -> set[str] | None:
    """Names whose parameters reach an optimizer built in ``fn`` (through the call's arguments
    and the variables they name, one assignment back); None when ``fn`` builds none. A module
    cast to ``weight_dtype`` next to an optimizer that does not hold it is not being trained
    (diffusers' T2I-adapter script trains the adapter, not the UNet). ``any_method``: the
    receiver of any method called there counts (``net.prepare_optimizer_params()``), not only
    of ``parameters()``."""
    built = [c for c in ast.walk(fn) if isinstance(c, ast.Call)
             and any(v.kind == av.OPTIMIZER for v in ctx.values.value(c))]
    if any_method:
        built += _used_as_optimizer(fn)
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
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (any_method or n.func.attr in (
                        "parameters", "named_parameters")) and dotted(n.func.value) \
                        and dotted(n.func.value).split(".")[0] not in ctx.aliases:  # not a module's function
                    out.add(dotted(n.func.value).split(".")[0])
                elif isinstance(n, ast.Name) and n.id in assigned:
                    more.append(assigned.pop(n.id))
        exprs = more
    return out


def _used_as_optimizer(fn: ast.AST) -> list[ast.Call]:
    """Calls bound to a name that ``fn`` then uses as an optimizer (``opt.zero_grad()``,
    ``scaler.step(opt)``): an optimizer from outside torch.optim (bitsandbytes' ``Adam8bit``),
    known by its use."""
    used = {c.func.value.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == "zero_grad" and isinstance(c.func.value, ast.Name)}
    used |= {c.args[0].id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
             and c.func.attr == "step" and len(c.args) == 1 and isinstance(c.args[0], ast.Name)}
    return [st.value for st in ast.walk(fn) if isinstance(st, ast.Assign) and isinstance(st.value, ast.Call)
            and any(isinstance(t, ast.Name) and t.id in used for t in st.targets)]


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
        return self.ctx.literal_dtype(node) == FLOAT16

    def _hit(self, node: ast.AST, test: ast.AST) -> None:
        self.report(node, f"float16 chosen on the bfloat16 path (`{ast.unparse(test)[:60]}`): a bfloat16 model "
                          "run in float16 can pass its range (65504)")


_MODEL_WORDS = re.compile(r"model|module|net|encoder|decoder|transformer|unet|vae|t5|clip|backbone", re.I)
_PRECISION_WORDS = re.compile(r"(?<![a-z])(fp16|float16|half|bf16|bfloat16|dtype|precision|amp|mixed)(?![a-z])",
                              re.I)  # whole words of a name: not the "amp" of "sample"


def _bf16_option(ctx: FileContext) -> str | None:
    """Where the program this module belongs to offers bfloat16 as a choice: a switch or a
    value named bf16 (``cfg.bf16``, ``"bf16"``, ``--bf16``, ``use_bf16=``) in the module, a
    module that uses it (its package included) or one those import. A folder of separate
    scripts is not one program: one script's ``--bf16`` says nothing of another's casts."""
    return next((f"{m.path.rsplit('/', 1)[-1]}:{n.lineno}" for m in ctx.project.program_of(ctx)
                 for n in _bf16_choices(m)), None)


@per_module
def _bf16_choices(m: FileContext) -> list[ast.AST]:
    """The nodes of ``m`` that offer bfloat16 as a choice: a switch
    (``cfg.bf16``, ``use_bf16=``), a command-line option (``"--bf16"``, ``choices=[..., "bfloat16"]``),
    and the string "bf16" compared with, keyed in a table or given as a precision or dtype
    (``dtype == "bf16"``, ``{"bf16": torch.bfloat16}``, ``mixed_precision="bf16"``); not "bf16" as
    one format of a list."""
    keys = {id(k) for n in m.nodes if isinstance(n, ast.Dict) for k in n.keys if k is not None}
    return [n for n in m.nodes if _names_bf16_choice(m, n, keys)]


def _names_bf16_choice(m: FileContext, n: ast.AST, dict_keys: set[int]) -> bool:
    if isinstance(n, ast.Attribute):  # a switch, not the dtype (torch.bfloat16) or a cast (x.bfloat16())
        parent = m.parents.get(n)
        return _bf16_word(n.attr) and not (isinstance(parent, ast.Call) and parent.func is n) \
            and not (m.qualname(n) or "").startswith("torch.")
    if isinstance(n, ast.keyword):
        return _bf16_word(n.arg or "")
    if not (isinstance(n, ast.Constant) and isinstance(n.value, str)):
        return False
    if n.value.startswith("--"):
        return _bf16_word(n.value[2:])
    parent = m.parents.get(n)
    return _bf16_word(n.value) and (id(n) in dict_keys or isinstance(parent, ast.Compare) or (
        isinstance(parent, ast.keyword) and any(w in (parent.arg or "") for w in ("precision", "dtype")))
        or (isinstance(parent, (ast.List, ast.Tuple)) and _is_choices(m, parent)))


def _is_choices(m: FileContext, options: ast.AST) -> bool:
    """``options`` is a command-line option's choices (``choices=[...]``, ``{"choices": [...]}``)."""
    holder = m.parents.get(options)
    if isinstance(holder, ast.keyword):
        return holder.arg == "choices"
    return isinstance(holder, ast.Dict) and any(
        v is options and isinstance(k, ast.Constant) and k.value == "choices" for k, v in zip(holder.keys, holder.values))


def _bf16_word(word: str) -> bool:
    word = word.lower().replace("-", "_")
    return any(word == w or word.startswith(("use_", "pure_", "enable_")) and word.endswith(w) for w in _BF16_WORDS)


def _precision_guarded(ctx: FileContext, node: ast.AST) -> bool:
    """``node`` sits under a precision choice: an ``if``/conditional expression whose test
    names a precision or a dtype, or a function named for one (``convert_to_fp16``)."""
    for a in ctx.parents_chain(node):
        if isinstance(a, (ast.If, ast.IfExp, ast.While)) and _PRECISION_WORDS.search(ast.unparse(a.test)):
            return True
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)) and _PRECISION_WORDS.search(a.name):
            return True
    return False


class Float16OverBf16Option(RuleVisitor):
    """AMP001 for float16 hard-coded in a project that offers bfloat16: a literal ``.half()`` /
    ``.to(torch.float16)`` of a model, or ``torch.float16`` given as a model's or a compute
    dtype (``torch_dtype=``, ``bnb_4bit_compute_dtype=``, ``dtype = torch.half``), with no
    precision choice around it. A run the user configured in bfloat16 gets float16 here
    (metaseq's generator and its GPU-initialised Linear, axolotl's LoRA merge, Open-Sora's
    sharded T5)."""

    def run(self):
        ctx = self.ctx
        if test_module(ctx):
            return self.hits  # tests pin precisions on purpose
        where = None
        for node in self._float16_literals():
            if _precision_guarded(ctx, node):
                continue
            where = where or _bf16_option(ctx)
            if where is None:
                return self.hits
            part = _component(ctx, node)
            what = ast.unparse(node)[:50]
            note = f" ({part}: a part whose precision may be its own)" if part else ""
            self.report(node, f"float16 hard-coded (`{what}`) with no precision choice around it, in a project that "
                              f"offers bfloat16 ({where}): a bfloat16 run gets float16 here, range 65504{note}",
                        Confidence.MEDIUM if part else Confidence.HIGH)
        return self.hits

    def _float16_literals(self):
        """Model casts to a float16 literal, and float16 literals given as a model's or a
        compute dtype (a ``dtype=`` of a Parameter's tensor, a name set once and used so)."""
        ctx = self.ctx
        for node in ctx.nodes:
            if isinstance(node, ast.Call) and ctx.lowp_cast_dtype(node) == "float16" and _literal_float16(ctx, node) \
                    and _MODEL_WORDS.search(_last_word(node.func.value)):
                yield node
            elif isinstance(node, ast.keyword) and ctx.literal_dtype(node.value) == FLOAT16 \
                    and _model_dtype_keyword(ctx, node):
                yield node.value
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and node.targets[0].id.endswith("dtype") and _set_once(ctx, node) and _model_dtype_name(ctx, node):
                yield from (v for v in ([node.value.body, node.value.orelse] if isinstance(node.value, ast.IfExp)
                                        else [node.value]) if ctx.literal_dtype(v) == FLOAT16)


def _component(ctx: FileContext, node: ast.AST) -> str:
    """The part of a pipeline a cast names when it is not the model itself (``vae``,
    ``pipeline.transformer``): a VAE kept in float16 on purpose is common; '' for the model."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return ""
    word = _last_word(node.func.value)
    return "" if "model" in word.lower() else word


def _last_word(expr: ast.AST) -> str:
    """The name a receiver is known by: ``model`` of ``self.model``, ``build_model`` of
    ``task.build_model(cfg)``, ``in_tensors`` of ``in_tensors[k]``."""
    while isinstance(expr, (ast.Call, ast.Subscript)):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.attr if isinstance(expr, ast.Attribute) else expr.id if isinstance(expr, ast.Name) else ""


def _model_dtype_keyword(ctx: FileContext, kw: ast.keyword) -> bool:
    """``torch_dtype=`` / ``param_dtype=`` / ``*compute_dtype=``, or ``dtype=`` of a tensor
    made inside ``Parameter(...)``; not a cast (the cast is its own finding)."""
    call = ctx.parents.get(kw)
    if not isinstance(call, ast.Call) or ctx.lowp_cast_dtype(call):
        return False
    if kw.arg in ("torch_dtype", "param_dtype") or (kw.arg or "").endswith("compute_dtype"):
        return True
    return kw.arg == "dtype" and in_parameter(ctx, call)


def _model_dtype_name(ctx: FileContext, assign: ast.Assign) -> bool:
    """The assigned name is a model's or a compute dtype: named so (``compute_dtype``,
    ``torch_dtype``, ``param_dtype``) or given as such in its function (``dtype = torch.half``,
    then ``Parameter(torch.empty(..., dtype=dtype))``); an inputs' dtype is not."""
    name = assign.targets[0].id
    if name.endswith(("compute_dtype", "torch_dtype", "param_dtype")):
        return True
    return any(isinstance(k, ast.keyword) and isinstance(k.value, ast.Name) and k.value.id == name
               and _model_dtype_keyword(ctx, k) for k in ast.walk(ctx.enclosing_function(assign)))


def _set_once(ctx: FileContext, assign: ast.Assign) -> bool:
    """The assigned name gets no other value in its function (``dtype = torch.float16`` then
    ``dtype = state[k].dtype`` in a loop is a default, not a choice)."""
    name = assign.targets[0].id
    fn = ctx.enclosing_function(assign)
    return sum(isinstance(t, ast.Name) and t.id == name for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])) == 1


def _literal_float16(ctx: FileContext, call: ast.Call) -> bool:
    """A cast that names float16 itself (``.half()``, ``.to(torch.float16)``), not a dtype variable."""
    return call.func.attr == "half" or any(ctx.literal_dtype(a) == FLOAT16 for a in
                                           [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")])


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (ManualCast.rule,)
