"""Loss scaling: float16 training without a GradScaler (AMP008), gradients clipped or changed
before ``unscale_`` (AMP010), ``unscale_`` on every micro-step (AMP013), a GradScaler on the
bfloat16 path (AMP015)."""
from __future__ import annotations

import ast
import itertools

from quant.vocabulary import Severity
from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import (
    on_non_amp_branch,
    training_backward_calls,
    training_lowp_casts,
)
from training_profiler.amp_checker.rules.base import Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import _callee, _has_kw, _selects_bf16


@declare_rule(
    "AMP008", "fp16-without-gradscaler", Severity.HIGH, training_path=True,
    explanation=(
        "float16 gradients underflow to zero (smallest subnormal ~6e-8) without loss scaling; "
        "CUDA autocast defaults to float16."),
    suggestion=(
        "Use torch.amp.GradScaler: scaler.scale(loss).backward(); scaler.step(opt); scaler.update(), "
        "or train in bfloat16."))
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
    updated = {dotted(c.func.value) for c in calls if c.func.attr == "update" and not c.args}
    return [c for c in calls if c.func.attr == "step" and c.args
            and (dotted(c.func.value) in updated or av.SCALER in ctx.values.kinds(c.func.value))]


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


@declare_rule(
    "AMP010", "clip-without-unscale", Severity.MEDIUM, training_path=True,
    explanation=(
        "With a GradScaler the gradients are multiplied by the scale; clipping them before "
        "scaler.unscale_ clips against the wrong norm."),
    suggestion="Call scaler.unscale_(optimizer) before clip_grad_norm_, then scaler.step(optimizer).")
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


def _receiver(call: ast.Call) -> str:
    return (dotted(call.func.value) or "") if isinstance(call.func, ast.Attribute) else ""


class OptimizerStepAroundScaler(RuleVisitor):
    """AMP010 where a function scales the loss for backward (``scaler.scale(loss).backward()``)
    and then steps an optimizer itself, with no ``scaler.step``, ``unscale_`` or hand-off of the
    scaler in it: the update uses gradients still multiplied by the loss scale, and steps whose
    gradients overflowed are not skipped (LAVIS's shared training loop)."""

    def run(self):
        ctx = self.ctx
        by_fn: dict[ast.AST, list[ast.Call]] = {}
        known = {id(c) for c in ctx.scaler_calls}
        for c in ctx.calls:  # a GradScaler by value or use, or named one: `scaler.scale(loss).backward()`
            after = ctx.parents.get(c)
            if isinstance(after, ast.Attribute) and after.attr == "backward" and isinstance(c.func, ast.Attribute) \
                    and c.func.attr == "scale" and (id(c) in known or "scaler" in _receiver(c).rsplit(".", 1)[-1].lower()):
                by_fn.setdefault(ctx.enclosing_function(c), []).append(c)
        for fn, scaled in by_fn.items():
            scalers = {_receiver(c) for c in scaled} - {""}
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
            if fn is ctx.tree or not scalers or _scaler_steps(ctx, fn) or any(
                    _is_unscale(ctx, c) or _calls_helper_that(ctx, c, _is_unscale)
                    or any(dotted(a) in scalers for a in [*c.args, *(k.value for k in c.keywords)])
                    for c in calls):
                continue
            first = min(c.lineno for c in scaled)
            for c in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
                if (isinstance(c.func, ast.Attribute) and c.func.attr == "step" and not c.args
                        and c.lineno > first and _receiver(c) not in scalers and _is_optimizer(ctx, c.func.value)
                        and not on_non_amp_branch(ctx, c)):
                    self.report(c, f"{_receiver(c)}.step() on gradients the GradScaler scaled (line {first}) "
                                   "without scaler.step(): they still carry the loss scale, and overflowing "
                                   "steps are not skipped")
        return self.hits


def _is_optimizer(ctx: FileContext, expr: ast.AST) -> bool:
    return av.OPTIMIZER in ctx.values.kinds(expr) or "optim" in (dotted(expr) or "").rsplit(".", 1)[-1].lower()


def _scaler_method_calls(ctx: FileContext, fn: ast.AST, attr: str) -> list[ast.Call]:
    scaling = {_receiver(c) for c in ctx.scaler_calls if isinstance(c.func, ast.Attribute)}
    return [c for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == attr and (_receiver(c) in scaling
                                         or av.SCALER in ctx.values.kinds(c.func.value))]


@declare_rule(
    "AMP013", "unscale-every-micro-step", Severity.MEDIUM, training_path=True,
    explanation=(
        "With gradient accumulation, scaler.unscale_ must run only on the micro-step that calls "
        "scaler.step: a second unscale_ before update() raises, and later micro-batches add "
        "scaled gradients onto already unscaled ones."),
    suggestion="Put unscale_ (and the clipping after it) under the same condition as scaler.step/update.")
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


@declare_rule(
    "AMP015", "gradscaler-with-bf16", Severity.LOW, training_path=True,
    explanation=(
        "bfloat16 has float32's exponent range; a GradScaler on the bfloat16 path only adds inf "
        "checks and skipped steps."),
    suggestion="Create the GradScaler for float16 only (or pass enabled=(dtype == torch.float16)).")
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
                q.rsplit(".", 1)[-1].endswith("GradScaler") and av.SCALER_FACTORY in ctx.values.kinds(node.func)):
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


# the rules this family declares (the package puts every family's rules in id order)
RULES: tuple[Rule, ...] = (
    Fp16WithoutGradScaler.rule,
    ClipWithoutUnscale.rule,
    UnscaleEveryMicroStep.rule,
    GradScalerWithBf16.rule,
)
