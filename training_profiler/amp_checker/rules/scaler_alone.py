"""AMP030: a GradScaler that scales the loss of a forward nothing makes low precision.

Loss scaling exists for float16 gradients. A loop that builds ``torch.amp.GradScaler()`` and
runs ``scaler.scale(loss).backward()`` while no autocast, no half cast and no mixed-precision
engine appears anywhere in the project computes its forward in float32: the "fp16" switch only
multiplies and divides the loss (llama-recipes' non-FSDP fp16 path until 2023). The user asked
for mixed precision and silently trains in float32, at float32's speed and memory.
"""
from __future__ import annotations

import ast

from quant.vocabulary import Severity
from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import per_project
from training_profiler.amp_checker.rules.base import Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import plain_torch_scalers

#: what makes a forward low precision without the word autocast in this scan
_LOWP_ENGINES = ("initialize", "Accelerator", "deepspeed", "Fabric", "Trainer")
_ENGINE_PACKAGES = ("deepspeed", "apex", "accelerate", "lightning", "pytorch_lightning")


@per_project
def _lowp_anywhere(ctx: FileContext) -> bool:
    """Something in the project can run a forward in low precision (cached on the project):
    the word autocast anywhere (a name, an attribute, a string), a float16 cast, or an engine
    that applies precision itself (apex ``amp.initialize``, Accelerate, DeepSpeed, Lightning,
    the HF Trainer). A bfloat16 cast does not count: it needs no GradScaler; nor does FSDP's
    MixedPrecision: a plain GradScaler refuses its float16 gradients, and AMP027 asks for the
    sharded one there."""
    return any(_lowp_here(m) for m in ctx.project.program_modules(ctx))


def _lowp_here(m: FileContext) -> bool:
    if any(m.lowp_cast_dtype(c) == "float16" for c in m.manual_lowp_casts):
        return True
    for n in m.nodes:
        word = (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute)
                else n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else "")
        if "autocast" in word.lower() or word in _LOWP_ENGINES:
            return True
        imported = ([a.name for a in n.names] if isinstance(n, ast.Import)
                    else [n.module or ""] if isinstance(n, ast.ImportFrom) else [])
        if any(name.split(".")[0] in _ENGINE_PACKAGES for name in imported):
            return True
    return False


def _forward_of(fn: ast.AST, loss: ast.AST, before: int) -> ast.stmt | None:
    """The first statement of ``fn`` (before line ``before``) that assigns the scaled loss's
    name from a call: the forward whose precision the scaler was meant for."""
    name = dotted(loss)
    if not name or "." in name:
        return None
    for st in ast.walk(fn):
        if isinstance(st, ast.Assign) and st.lineno < before and any(
                isinstance(t, ast.Name) and t.id == name for t in st.targets) \
                and any(isinstance(c, ast.Call) for c in ast.walk(st.value)):
            return st
    return None


@declare_rule(
    "AMP030", "gradscaler-without-autocast", Severity.MEDIUM, training_path=True,
    explanation=("A GradScaler scales the loss, but nothing in the project runs the forward in low precision "
                 "(no autocast, no half cast, no mixed-precision engine): the model trains in float32 and the "
                 "fp16 switch only multiplies and divides the loss."),
    suggestion=("Run the forward and the loss under torch.autocast(device_type, dtype=torch.float16) on the "
                "same switch that turns the GradScaler on; or drop the scaler if float32 was meant."))
class GradScalerWithoutAutocast(RuleVisitor):
    """``s.scale(loss)`` on a plain torch GradScaler made in this module, where ``loss`` comes
    from a call in the same function (the forward is here) and nothing in the whole project can
    make a forward low precision. Reported at the forward."""

    def run(self):
        ctx = self.ctx
        made = plain_torch_scalers(ctx)
        if not made or _lowp_anywhere(ctx):
            return self.hits
        names = {dotted(t) for c in made for st in [ctx.parents.get(c)] if isinstance(st, ast.Assign)
                 for t in st.targets}
        for c in ctx.scaler_calls:
            if not (isinstance(c.func, ast.Attribute) and c.func.attr == "scale" and c.args):
                continue
            if dotted(c.func.value) not in names and av.SCALER not in ctx.values.kinds(c.func.value):
                continue
            forward = _forward_of(ctx.enclosing_function(c), c.args[0], c.lineno)
            if forward is not None:
                self.report(forward, f"this forward's loss is scaled by a GradScaler (line {c.lineno}) but nothing in "
                                     "the project runs it in low precision (no autocast, half cast or "
                                     "mixed-precision engine): it trains in float32")
        return self.hits


RULES: tuple[Rule, ...] = (GradScalerWithoutAutocast.rule,)
