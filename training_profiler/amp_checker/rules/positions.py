"""AMP026: rotary angles computed in a low precision the code did not choose.

Rotary embeddings multiply integer positions by a frequency table and take cos/sin of the
product. Two ways the angle ends up in the model's low precision without any cast to it:

- positions made in the dtype of the frequency buffer (``arange(n).type_as(self.inv_freq)``,
  ``dtype=self.inv_freq.dtype``): a buffer is cast with its module, so once the model is cast to
  bfloat16 (``model.bfloat16()``, DeepSpeed's bf16, pure-bf16 FSDP) the positions are bfloat16,
  which holds integers exactly only up to 256 (float16: 2048). Position 1000 becomes 1000 or
  1004, and every angle with it (gpt-neox until 2023; transformers' Llama until 2023);
- the angle table cast to the activations' dtype before cos/sin (``freqs = freqs.to(t)``, then
  ``freqs.cos()``): an angle of 1000 rad in bfloat16 is off by up to 2 rad, a random rotation
  (rotary-embedding-torch until 2023). Casting cos/sin afterwards costs the same and is exact
  to the activations' own precision.
"""
from __future__ import annotations

import ast
import re

from quant.vocabulary import BFLOAT16, FLOAT16, LOW_PRECISION_DTYPES, Severity
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.precision import (
    expects_lowp_activations,
    in_model_library,
    own_precisions,
)
from training_profiler.amp_checker.rules.base import (
    LIBRARY_NOTE,
    Confidence,
    Rule,
    RuleVisitor,
    declare_rule,
)
from training_profiler.amp_checker.rules.helpers import (
    EXACT_INTEGERS,
    classes_calling,
    registered_buffers,
)

_FREQUENCY = re.compile(r"freq|theta|omega", re.I)
_ANGLE = re.compile(r"freq|angle|theta|sinusoid|phase", re.I)
_TRIG = {"cos", "sin"}
_DEVICE = re.compile(r"device|dev$|cuda|cpu", re.I)


def _frequency_buffers(cls: ast.ClassDef) -> set[str]:
    """Buffers the class registers that hold frequencies: a name that says so, or a value
    computed by division or a power (``1.0 / base ** ...``)."""
    return {name for name, value in registered_buffers(cls).items()
            if _FREQUENCY.search(name) or any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.Pow))
                                               for n in ast.walk(value))}


def _dtype_source(ctx: FileContext, call: ast.Call) -> ast.AST | None:
    """The tensor whose dtype a cast follows: ``x.type_as(T)``, ``x.to(T)``, ``x.to(T.dtype)``,
    ``x.to(dtype=T.dtype)``; None for any other call."""
    f = call.func
    if not isinstance(f, ast.Attribute) or f.attr not in ("type_as", "to"):
        return None
    arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "dtype"), None)
    if isinstance(arg, ast.Attribute) and arg.attr == "dtype":
        return arg.value
    if f.attr == "type_as" or (isinstance(arg, (ast.Name, ast.Attribute, ast.Subscript))
                               and not (ctx.qualname(arg) or "").startswith("torch.")
                               and not _DEVICE.search(dotted(arg) or "")):
        return arg
    return None


def _is_arange(ctx: FileContext, node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (ctx.qualname(node.func) or "").endswith("arange")


def _positions(ctx: FileContext, fn: ast.AST, node: ast.AST) -> bool:
    """``node`` is an ``arange`` or a name this function bound to one."""
    if _is_arange(ctx, node):
        return True
    if not isinstance(node, ast.Name):
        return False
    return any(isinstance(st, ast.Assign) and _is_arange(ctx, st.value)
               and any(isinstance(t, ast.Name) and t.id == node.id for t in st.targets)
               for st in ast.walk(fn))


def _low_precision_model(ctx: FileContext, cls: ast.ClassDef) -> tuple[Confidence, str] | None:
    """How sure we are that this class's buffers end up in a low precision, and why."""
    names = {ctx.dtype_of(n) for n in ast.walk(cls) if isinstance(n, ast.Attribute)
             and (ctx.qualname(n) or "").startswith("torch.")} | {
        ctx.lowp_cast_dtype(c) for c in ast.walk(cls) if isinstance(c, ast.Call)}
    lowp = sorted(names & set(LOW_PRECISION_DTYPES))
    if lowp:
        return Confidence.HIGH, f" (this class is written for {' and '.join(lowp)} models)"
    if any(own_precisions(m) for m in ctx.project.program_modules(ctx)):
        return Confidence.HIGH, " (the project trains in low precision)"
    expects = expects_lowp_activations(ctx)
    if expects:
        return Confidence.HIGH, expects
    if in_model_library(ctx):
        return Confidence.MEDIUM, LIBRARY_NOTE.format(why="a bfloat16 or float16 model casts this buffer")
    return Confidence.LOW, " (no training seen; if the model is cast to bfloat16 or float16, so is this buffer)"


@declare_rule(
    "AMP026", "rotary-angles-in-low-precision", Severity.MEDIUM,
    explanation=("Rotary angles are positions times frequencies. Positions made in the dtype of the frequency "
                 "buffer become bfloat16 when the model is cast to it (a buffer is cast with its module), and "
                 "bfloat16 holds integers exactly only up to 256 (float16: 2048); an angle table cast to the "
                 "activations' dtype before cos/sin is off by up to 2 rad at 1000 rad in bfloat16."),
    suggestion=("Make positions and angles in float32 (`torch.arange(n, dtype=torch.float32)`, "
                "`self.inv_freq.float()`), take cos/sin there, and cast only cos/sin to the activations' dtype."))
class RotaryAnglesInLowPrecision(RuleVisitor):
    """``arange(n).type_as(self.inv_freq)`` (a registered frequency buffer) in a class's method,
    and ``freqs = freqs.to(t)`` followed by ``freqs.cos()`` with ``t`` a parameter."""

    def run(self):
        ctx = self.ctx
        if not any(isinstance(c.func, ast.Attribute) and c.func.attr in _TRIG | {"register_buffer"}
                   or (ctx.qualname(c.func) or "").endswith(("torch.cos", "torch.sin")) for c in ctx.calls):
            return self.hits
        for cls in classes_calling(ctx, "register_buffer"):
            self._positions_in_buffer_dtype(cls)
        for fn in (n for n in ctx.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            self._angles_cast_before_trig(fn)
        return self.hits

    def _positions_in_buffer_dtype(self, cls: ast.ClassDef) -> None:
        ctx = self.ctx
        buffers = _frequency_buffers(cls)
        if not buffers:
            return
        for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for c in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                source, positions = _dtype_source(ctx, c), None
                if source is not None and isinstance(c.func, ast.Attribute) and _positions(ctx, fn, c.func.value):
                    positions = c
                elif _is_arange(ctx, c):
                    dt = next((k.value for k in c.keywords if k.arg == "dtype"), None)
                    source = dt.value if isinstance(dt, ast.Attribute) and dt.attr == "dtype" else None
                    positions = c if source is not None else None
                buffer = (dotted(source) or "") if positions is not None else ""
                if buffer.startswith("self.") and buffer[5:] in buffers:
                    confidence, why = _low_precision_model(ctx, cls)
                    self.report(c, f"positions take `{buffer}`'s dtype: a model cast to bfloat16 (float16) rounds "
                                   f"positions above {EXACT_INTEGERS[BFLOAT16]} ({EXACT_INTEGERS[FLOAT16]}), and "
                                   f"the rotary angles with them{why}", confidence)

    def _angles_cast_before_trig(self, fn: ast.AST) -> None:
        ctx = self.ctx
        params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)} - {"self", "cls"}
        for st in ast.walk(fn):
            if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                    and isinstance(st.value, ast.Call) and _ANGLE.search(st.targets[0].id)):
                continue
            name, source = st.targets[0].id, _dtype_source(ctx, st.value)
            root = st.value.func.value if isinstance(st.value.func, ast.Attribute) else None
            while isinstance(root, ast.Subscript):
                root = root.value
            if not (isinstance(source, ast.Name) and source.id in params and isinstance(root, ast.Name)
                    and root.id == name):
                continue
            trig = next((c for c in ast.walk(fn) if isinstance(c, ast.Call) and c.lineno > st.lineno
                         and _trig_of(ctx, c) == name), None)
            if trig is not None:
                confidence, why = self._activations_confidence()
                self.report(st.value, f"`{name}` is cast to `{source.id}`'s dtype before {ast.unparse(trig.func)}"
                                      f"() at line {trig.lineno}: in bfloat16 an angle of 1000 rad is off by up to "
                                      f"2 rad{why}", confidence)

    def _activations_confidence(self) -> tuple[Confidence, str]:
        ctx = self.ctx
        if any(own_precisions(m) for m in ctx.project.program_modules(ctx)):
            return Confidence.HIGH, " (the project trains in low precision)"
        if in_model_library(ctx):
            return Confidence.MEDIUM, LIBRARY_NOTE.format(why="with bfloat16 or float16 activations the angles are too")
        return Confidence.LOW, " (no training seen; with bfloat16 or float16 activations the angles are too)"


def _trig_of(ctx: FileContext, call: ast.Call) -> str | None:
    """The name ``call`` takes cos/sin of: ``n.cos()``, ``torch.sin(n)``."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr in _TRIG and isinstance(f.value, ast.Name) and not call.args:
        return f.value.id
    if (ctx.qualname(f) or "") in ("torch.cos", "torch.sin") and call.args and isinstance(call.args[0], ast.Name):
        return call.args[0].id
    return None


RULES: tuple[Rule, ...] = (RotaryAnglesInLowPrecision.rule,)
