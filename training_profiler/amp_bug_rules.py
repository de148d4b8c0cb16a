"""Rules for AMP bug kinds that public projects fixed, judged against how the model trains.

Each covers a kind the original rules could not reach:

- gradients changed before ``unscale_`` in an optimizer-update helper the scaler reaches as a
  parameter, however many calls deep (recognised by use: ``s.step(opt)`` with ``s.update()``);
- float32 copies made for a softmax and then not used (the scores stay in float16);
- a mask constant beyond float16's range, or Adam's eps below float16's subnormals, in a model
  that trains in float16 by ``torch_dtype=``, ``.half()``, autocast or a trainer's fp16 flag;
- a checkpoint that keeps the optimizer but not the GradScaler (AMP018);
- linear attention's ``k^T v`` and its normaliser summed over the sequence in float16 (AMP019).
"""
from __future__ import annotations

import ast
import re

from training_profiler import amp_values as av
from training_profiler.amp_context import FileContext, dotted
from training_profiler.amp_intent import is_float32_cast, on_non_amp_branch
from training_profiler.amp_precision import FLOAT16, lowp_parameters, own_precisions, trains_in
from training_profiler.amp_intent import no_grad_region
from training_profiler.amp_rules import LossOutsideAutocast
from training_profiler.amp_rules import (_FILL_CALLS, _OPTIMIZERS, _SOFTMAX, FP16_MAX, FP16_MIN_SUBNORMAL,
                                         NO_TRAINING_NOTE, Confidence, Rule, RuleVisitor, Severity,
                                         _calls_helper_that, _const_value, _fp16_evidence, _has_kw,
                                         _is_torch_clip, _is_unscale, _scaler_steps, training_lowp_casts)


def _fp16_confidence(ctx: FileContext, node: ast.AST | None = None) -> tuple[Confidence, str]:
    """How sure we are that this module's code runs in float16, and a note when not sure."""
    scope = ctx.scope_of(node) if node is not None else None
    if (scope is not None and scope.enabled and scope.dtype == FLOAT16) or trains_in(ctx, FLOAT16):
        return Confidence.HIGH, ""
    if any(FLOAT16 in own_precisions(m) for m in ctx.project.modules.values()):
        return Confidence.MEDIUM, " (float16 training elsewhere in the project)"
    return Confidence.LOW, NO_TRAINING_NOTE.format(why="float16").replace(
        "no training seen; if this runs under AMP, float16", "no float16 training seen; if this trains in float16")


def _callee(ctx: FileContext, call: ast.Call) -> str:
    """The called name's last part, for a method of any receiver (``x.mean(-1).masked_fill``)."""
    name = ctx.call_name(call) or (call.func.attr if isinstance(call.func, ast.Attribute) else "")
    return name.rsplit(".", 1)[-1]


# ---- AMP010: gradients changed before unscale_ -----------------------------------------------------
def _grad_change(node: ast.AST) -> bool:
    """``p.grad.add_(noise)``, ``p.grad.data.mul_(c)``, ``p.grad += noise``, ``p.grad = p.grad + n``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_") \
            and ".grad" in "." + (dotted(node.func.value) or ""):
        return (dotted(node.func.value) or "").split(".")[-1] in ("grad", "data")
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
    return any(isinstance(t, ast.Attribute) and t.attr == "grad" for t in targets)


def _helper_changes_grads(ctx: FileContext, call: ast.Call) -> bool:
    """``call`` goes to a project function that adds to or scales ``.grad`` (gradient noise)."""
    return any(v.kind == av.FUNCTION and v.node is not None and any(_grad_change(n) for n in ast.walk(v.node))
               for v in ctx.values.value(call.func))


class GradsChangedBeforeUnscale(RuleVisitor):
    """A function that steps a GradScaler and, before it, clips or adds to the gradients with no
    ``unscale_`` in between: the gradients are still multiplied by the loss scale."""

    def run(self):
        ctx = self.ctx
        fns = {ctx.enclosing_function(c) for c in ctx.calls if isinstance(c.func, ast.Attribute) and c.func.attr == "step"}
        for fn in fns:
            steps = _scaler_steps(ctx, fn)
            if not steps:
                continue
            last = max(s.lineno for s in steps)
            unscale = [c.lineno for c in ast.walk(fn) if isinstance(c, ast.Call)
                       and (_is_unscale(ctx, c) or _calls_helper_that(ctx, c, _is_unscale))]
            for n in ast.walk(fn):
                if getattr(n, "lineno", last) >= last or any(u < n.lineno for u in unscale):
                    continue
                clip = isinstance(n, ast.Call) and _is_torch_clip(ctx, n)
                helper = isinstance(n, ast.Call) and _helper_changes_grads(ctx, n)
                if (clip or helper or _grad_change(n)) and not on_non_amp_branch(ctx, n):
                    what = (ctx.call_name(n) or "clip").split(".")[-1] if clip else \
                        f"{_callee(ctx, n)} (it changes gradients)" if helper else "gradients changed"
                    self.report(n, f"{what} before the GradScaler's unscale_ (it steps at line {last}): "
                                   "the gradients still carry the loss scale")
        return self.hits


# ---- AMP003: an evaluation loss after the block ------------------------------------------------
class EvalLossOutsideAutocast(LossOutsideAutocast):
    """A validation loss computed after the autocast block (entered through a ``partial`` bound
    elsewhere, as timm-style ``validate(..., amp_autocast=...)`` does) on its low-precision
    outputs: not a training signal, but the metric that picks checkpoints and stops early is
    computed in float16 (MEDIUM)."""

    def _judged(self, call: ast.Call) -> bool:
        return no_grad_region(self.ctx, call)

    def _say(self, call: ast.Call, name: str) -> None:
        self.report(call, f"evaluation loss `{name}(...)` computed outside the autocast block, in its "
                          "low precision", Confidence.MEDIUM)

    def _prepared_model_losses(self) -> None:
        return None


# ---- AMP004: float32 copies made and not used ----------------------------------------------------
def _loads_after(fn: ast.AST, name: str, line: int) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) and n.lineno > line
               for n in ast.walk(fn))


class UnusedUpcastSoftmax(RuleVisitor):
    """``q32 = q.float()`` for the attention scores, then a softmax without dtype on scores made
    from the original tensors: the upcast copies are never read, so the softmax runs in float16."""

    def run(self):
        ctx = self.ctx
        for fn in (n for n in ast.walk(ctx.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            dead = [(t.id, st.lineno) for st in ast.walk(fn) if isinstance(st, ast.Assign)
                    and is_float32_cast(ctx, st.value) for t in st.targets if isinstance(t, ast.Name)
                    and not _loads_after(fn, t.id, st.lineno)]
            if not dead:
                continue
            for c in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                name = ctx.call_name(c) or ""
                is_softmax = name in _SOFTMAX or (isinstance(c.func, ast.Attribute) and c.func.attr in
                                                  ("softmax", "log_softmax") and not name.startswith("torch."))
                copies = [d for d, line in dead if line < c.lineno]
                if is_softmax and copies and not _has_kw(c, "dtype") and not ctx.in_autocast(c):
                    self.report(c, f"softmax without dtype: the float32 copies {', '.join(f'`{d}`' for d in copies)} "
                                   "made above are never used, so the scores stay in the input's precision")
        return self.hits


# ---- AMP011 / AMP012 against the training precision -------------------------------------------
def _mentions_mask(expr: ast.AST) -> bool:
    return any(isinstance(n, (ast.Name, ast.Attribute)) and re.search(r"mask|bias", dotted(n) or "", re.I)
               for n in ast.walk(expr))


class MaskConstantAgainstTraining(RuleVisitor):
    """A fill (``masked_fill(m, -1e9)``) or an additive mask (``(1 - mask) * -1e10``) beyond
    float16's range, in code that trains in float16 by any means (``torch_dtype=``, ``.half()``,
    autocast, a trainer's fp16 flag), here or in a module that uses this one."""

    def run(self):
        ctx = self.ctx
        if _fp16_evidence(ctx) or (own_precisions(ctx) and FLOAT16 not in own_precisions(ctx)):
            return self.hits  # AMP011 itself judged this module, or it trains in bfloat16
        for n in ast.walk(ctx.tree):
            consts: list[ast.AST] = []
            if isinstance(n, ast.Call) and _callee(ctx, n) in _FILL_CALLS:
                consts = [*n.args, *(k.value for k in n.keywords)]
                where = _callee(ctx, n) + "()"
            elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult) and _mentions_mask(n):
                consts, where = [n.left, n.right], "an additive mask"
            for a in consts:
                v = _const_value(a)
                if v is not None and abs(v) > FP16_MAX:
                    conf, note = _fp16_confidence(ctx, n)
                    self.report(a, f"constant {v:g} in {where} is outside the float16 range (±{FP16_MAX:g}){note}", conf)
        return self.hits


# default eps of torch's optimizers (and of transformers' Trainer, which builds AdamW)
_DEFAULT_EPS = {"Adam": 1e-8, "AdamW": 1e-8, "Adamax": 1e-8, "NAdam": 1e-8, "RAdam": 1e-8,
                "RMSprop": 1e-8, "Adagrad": 1e-10}
_TRAINERS = ("Trainer", "Seq2SeqTrainer", "SFTTrainer")


class EpsAgainstParameters(RuleVisitor):
    """An Adam-family optimizer (or a library Trainer, which builds AdamW with eps=1e-8) on float16
    parameters (``from_pretrained(torch_dtype=torch.float16)`` or a ``.half()`` model that
    trains), with eps, given or default, below float16's smallest subnormal."""

    def visit_Call(self, node: ast.Call) -> None:
        ctx = self.ctx
        name = (ctx.call_name(node) or "").split(".")[-1]
        if (name in _OPTIMIZERS or name in _TRAINERS) and lowp_parameters(ctx) == FLOAT16:
            already = any(ctx.lowp_cast_dtype(c) == FLOAT16 for c in training_lowp_casts(ctx))
            eps_kw = next((k.value for k in node.keywords if k.arg == "eps"), None)
            if name in _TRAINERS:
                if not _has_kw(node, "optimizers") and not _trainer_eps_given(ctx):
                    self.report(node, f"{name}'s default AdamW eps=1e-08 rounds to 0 on float16 parameters")
            elif eps_kw is None and name in _DEFAULT_EPS and len(node.args) < 5:
                self.report(node, f"optimizer default eps={_DEFAULT_EPS[name]:g} rounds to 0 in float16 parameters")
            elif eps_kw is not None and not already:
                v = _const_value(eps_kw)
                if v is not None and 0 < v < FP16_MIN_SUBNORMAL:
                    self.report(eps_kw, f"optimizer eps={v:g} rounds to 0 in float16 parameters")
        self.generic_visit(node)


def _trainer_eps_given(ctx: FileContext) -> bool:
    return any(k.arg == "adam_epsilon" for c in ctx.calls for k in c.keywords)


# ---- AMP018: the GradScaler's state left out of a checkpoint -------------------------------------
def _scalerish(ctx: FileContext, expr: ast.AST) -> bool:
    """Something of the loss scaler: a GradScaler (by value or name), apex's ``amp`` state, a key
    naming one."""
    return any((isinstance(n, ast.Constant) and isinstance(n.value, str) and re.search(r"scaler|loss_scale|amp", n.value))
               or (isinstance(n, (ast.Name, ast.Attribute)) and (re.search(r"scaler|loss_scale|(^|\.)amp$", dotted(n) or "", re.I)
                                                               or av.SCALER in ctx.values.kinds(n)))
               for n in ast.walk(expr))


def _optimizer_state(ctx: FileContext, expr: ast.AST) -> bool:
    """``optimizer.state_dict()`` (by value or name) somewhere in ``expr``."""
    for n in ast.walk(expr):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "state_dict":
            r = n.func.value
            if av.OPTIMIZER in ctx.values.kinds(r) or "optim" in (dotted(r) or "").lower():
                return True
    return False


def _saved_dict(ctx: FileContext, call: ast.Call) -> list[ast.AST]:
    """What a ``torch.save(obj, ...)`` saves: the dict literal, or a name bound to one plus the
    ``obj[key] = value`` stores into it in the same function."""
    if not call.args:
        return []
    obj = call.args[0]
    if isinstance(obj, ast.Dict):
        return [obj]
    if not isinstance(obj, ast.Name):
        return []
    fn = ctx.enclosing_function(call)
    out: list[ast.AST] = []
    for st in ast.walk(fn):
        if isinstance(st, ast.Assign):
            for t in st.targets:
                if (isinstance(t, ast.Name) and t.id == obj.id) or (
                        isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == obj.id):
                    out += [t, st.value]
    return out


def _module_saves_scaler(ctx: FileContext) -> bool:
    return any(isinstance(c.func, ast.Attribute) and c.func.attr == "state_dict" and _scalerish(ctx, c.func.value)
               for c in ctx.calls)


class ScalerStateNotCheckpointed(RuleVisitor):
    """A function that checkpoints the optimizer's state (``torch.save`` of a dict holding it, a
    ``save_*`` call given it, a Checkpointer given ``optimizer=``) and nothing of the GradScaler,
    in code whose training uses one."""

    def run(self):
        ctx = self.ctx
        if not (ctx.has_gradscaler or any(m.has_gradscaler for m in ctx.project.users_of(ctx))):
            return self.hits
        if _module_saves_scaler(ctx):
            return self.hits
        by_fn: dict[ast.AST, list[ast.Call]] = {}
        for c in ctx.calls:
            by_fn.setdefault(ctx.enclosing_function(c), []).append(c)
        for fn, calls in by_fn.items():
            saves = sorted((c for c in calls if self._saves_optimizer(c)), key=lambda c: (c.lineno, c.col_offset))
            if saves and not any(_scalerish(ctx, a) for c in saves for a in [*c.args, *(k.value for k in c.keywords)]):
                c = saves[0]
                callee = _callee(ctx, c)
                what = f"{callee} is given the optimizer" if "Checkpoint" in callee else "checkpoint saves the optimizer's state"
                self.report(c, f"{what} but not the GradScaler's")
        return self.hits

    def _saves_optimizer(self, c: ast.Call) -> bool:
        ctx = self.ctx
        callee = _callee(ctx, c)
        if "Checkpoint" in callee and callee[:1].isupper():
            return _has_kw(c, "optimizer")
        if "save" not in callee.lower():
            return False
        parts = _saved_dict(ctx, c) or [*c.args, *(k.value for k in c.keywords)]
        return any(_optimizer_state(ctx, p) for p in parts) and not any(_scalerish(ctx, p) for p in parts)


# ---- AMP019: linear attention's sums over the sequence ----------------------------------------------


def _transposed_name(expr: ast.AST) -> str | None:
    """``k.transpose(-2, -1)`` / ``k.mT`` / ``k.T`` -> 'k'."""
    if isinstance(expr, ast.Attribute) and expr.attr in ("mT", "T"):
        return dotted(expr.value)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "transpose" \
            and len(expr.args) == 2 and {_const_value(a) for a in expr.args} == {-2.0, -1.0}:
        return dotted(expr.func.value)
    return None


def _einsum_context(spec: str) -> bool:
    """'...nd,...ne->...de': one index summed, the second-to-last of both inputs."""
    m = re.fullmatch(r"\s*([\w.]+)\s*,\s*([\w.]+)\s*->\s*([\w.]+)\s*", spec)
    if not m:
        return False
    a, b, out = (s.replace("...", "") for s in m.groups())
    summed = (set(a) & set(b)) - set(out)
    return len(a) >= 2 and len(b) >= 2 and summed == {a[-2]} and b[-2] == a[-2] and out.endswith(a[-1] + b[-1])


class LinearAttentionSum(RuleVisitor):
    """``k^T v`` (and ``k.sum(dim=-2)``, its normaliser) sums over every token: in float16 the
    result passes 65504 on long sequences (linear attention's context and denominator)."""

    def run(self):
        ctx = self.ctx
        for n in ast.walk(ctx.tree):
            left = None
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
                left = _transposed_name(n.left)
            elif isinstance(n, ast.Call) and (ctx.call_name(n) or "").rsplit(".", 1)[-1] in ("matmul", "bmm") and n.args:
                left = _transposed_name(n.args[0])
            elif isinstance(n, ast.Call) and (ctx.call_name(n) or "").endswith("einsum") and len(n.args) == 3 \
                    and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str) \
                    and _einsum_context(n.args[0].value):
                left = dotted(n.args[1])
            if not left or not self._low_precision_here(n):
                continue
            conf, note = _fp16_confidence(ctx, n)
            self.report(n, f"`{ast.unparse(n)[:50]}` sums over the sequence (linear attention's context){note}", conf)
            fn = ctx.enclosing_function(n)
            for s in ast.walk(fn):
                if isinstance(s, ast.Call) and isinstance(s.func, ast.Attribute) and s.func.attr == "sum" \
                        and dotted(s.func.value) == left and _sums_sequence(s) and not _has_kw(s, "dtype"):
                    self.report(s, f"`{ast.unparse(s)[:50]}` sums `{left}` over the sequence (the normaliser){note}", conf)
        return self.hits

    def _low_precision_here(self, node: ast.AST) -> bool:
        """Not an upcast product, not under a bfloat16 or float32 autocast."""
        scope = self.ctx.scope_of(node)
        if scope is not None and scope.enabled and scope.dtype != FLOAT16:
            return False
        return not any(is_float32_cast(self.ctx, x) for x in ast.walk(node))


def _sums_sequence(call: ast.Call) -> bool:
    dims = [*call.args[:1], *(k.value for k in call.keywords if k.arg == "dim")]
    return any(_const_value(d) == -2.0 for d in dims)


NEW_RULES: tuple[Rule, ...] = (
    Rule("AMP018", "scaler-state-not-checkpointed", Severity.LOW,
         "A checkpoint that keeps the optimizer but not the GradScaler's state resumes a float16 run "
         "from the initial loss scale (65536): the first steps overflow and are skipped, and a scale "
         "that had grown or shrunk for this model is lost.",
         "Save scaler.state_dict() beside the optimizer's state and load it with scaler.load_state_dict().",
         ScalerStateNotCheckpointed),
    Rule("AMP019", "long-reduction-in-fp16", Severity.MEDIUM,
         "Linear attention sums k^T v and k over every token; in float16 these sums pass 65504 on long "
         "sequences (inf, then NaN after the normalising division).",
         "Compute the context and the normaliser in float32 (k.float(), v.float()) or under "
         "autocast(enabled=False), and cast the output back.",
         LinearAttentionSum),
)
