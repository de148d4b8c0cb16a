"""AMP020: numerically sensitive computations left to the caller's autocast.

Autocast picks a precision per op, not per purpose: a matmul of rotary frequencies and positions
runs in bfloat16 like any projection, and a T5 encoder's feed-forward runs in float16 like any
other. Some computations are known to break there. Public projects fixed exactly these by
wrapping them in ``autocast(enabled=False)``; the table below names each with its reason, so a
new entry is one row. An op counts when it is in code that runs with the model (not
``__init__``), outside an ``autocast(enabled=False)`` region and not on explicitly
float32-cast inputs where autocast would leave them alone.

Confidence: HIGH when the op is under an enabled autocast the scan sees (here or at every call
site), its module trains in a precision the entry is sensitive to, or it is a method of an
``nn.Module`` whose users train under an autocast of such (or an undecided) dtype, the project
turns autocast off around the same computation elsewhere (its authors know it runs under
autocast), or the module's own code tests its tensors for that dtype; MEDIUM when the project
trains in that precision elsewhere; LOW when no training is seen (the message says so).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quant.vocabulary import BFLOAT16, FLOAT16, LOW_PRECISION_DTYPES, Severity
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import float32_result
from training_profiler.amp_checker.precision import (
    expects_lowp_activations,
    in_model_library,
    own_precisions,
    trains_in,
)
from training_profiler.amp_checker.rules.base import (
    LIBRARY_NOTE,
    Confidence,
    Rule,
    RuleVisitor,
    declare_rule,
)
from training_profiler.amp_checker.rules.helpers import EXACT_INTEGERS, cast_inputs_dtype, names_in

_MATMULS = {"torch.matmul", "torch.mm", "torch.bmm", "torch.einsum", "torch.functional.einsum"}
_FREQ = re.compile(r"(^|_)(inv_freq|freqs?|inv_freqs|theta|inv_timescales?)(_|$)", re.I)
_POSITIONS = re.compile(r"(^|_)(pos|positions?|position_ids|t|seq|timesteps?|idx|ids|grid)(_|$)", re.I)
_SPECTRAL_CALLS = {"torch.stft", "torch.fft.fft", "torch.fft.rfft", "torch.fft.fft2", "torch.fft.rfft2",
                   "torch.fft.fftn", "torch.fft.rfftn"}
_SPECTRAL_NAME = re.compile(r"(stft|spectrogram|fbanks?$|filterbank|melspec|mel_spec|compute_mel)", re.I)
_T5_NAME = re.compile(r"^(t5|T5EncoderModel|T5Model|T5ForConditionalGeneration|MT5EncoderModel)$|^t5_", re.I)


def _matmul_operands(ctx: FileContext, node: ast.AST) -> list[ast.AST] | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return [node.left, node.right]
    if isinstance(node, ast.Call):
        name = ctx.call_name(node) or ""
        if name in _MATMULS:
            if "einsum" in name and not _einsum_contracts(node):
                return None  # an outer product: einsum multiplies elementwise, which autocast leaves in float32
            return [a for a in node.args if not isinstance(a, ast.Constant)]
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("matmul", "mm", "bmm") \
                and not name.startswith("torch."):
            return [node.func.value, *node.args]
    return None


def _einsum_contracts(call: ast.Call) -> bool:
    """Whether ``torch.einsum("i,j->ij", ...)`` sums over an index: only then does it reach a
    matmul (bmm) that autocast lowers; with no index summed it is a broadcast multiply. An
    equation not written out counts as contracting (nothing is known)."""
    eq = call.args[0] if call.args else None
    if not (isinstance(eq, ast.Constant) and isinstance(eq.value, str) and "->" in eq.value):
        return True
    inputs, output = eq.value.replace(" ", "").split("->", 1)
    return bool(set(inputs.replace(",", "").replace(".", "")) - set(output.replace(".", "")))


def rotary_product(ctx: FileContext, node: ast.AST) -> str | None:
    """Rotary / sinusoidal angles: a matmul (autocast runs it in low precision) of a frequency
    table with positions."""
    ops = _matmul_operands(ctx, node)
    if not ops or len(ops) < 2:
        return None
    freq = [o for o in ops if any(_FREQ.search(n) for n in names_in(o))]
    pos = [o for o in ops if o not in freq and any(_POSITIONS.search(n) for n in names_in(o))]
    if freq and pos:
        return f"`{ast.unparse(node)[:50]}` multiplies positions by rotary frequencies"
    return None


def _constructs(callee: str) -> bool:
    """``MelSpectrogram(...)``: building a module computes nothing; applying it does."""
    return callee[:1].isupper()


def spectral_features(ctx: FileContext, node: ast.AST) -> str | None:
    """An STFT / FFT, or a spectrogram or filterbank module applied in the model's forward."""
    if not isinstance(node, ast.Call):
        return None
    name = ctx.call_name(node) or ""
    if name in _SPECTRAL_CALLS:
        if node.args and float32_result(ctx, node.args[0]):
            return None  # not autocast-listed: a float32 input keeps it in float32
        return f"`{name}` on the model's activations"
    callee = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id \
        if isinstance(node.func, ast.Name) else ""
    if _SPECTRAL_NAME.search(callee) and not _constructs(callee) \
            and not name.startswith(("torch.", "np.", "numpy.", "librosa.")):
        return f"`{callee}(...)` computes spectral features"
    return None


def _self_attr_sources(ctx: FileContext, func: ast.AST) -> list[ast.AST]:
    """What ``self.<attr>`` was set to anywhere in the enclosing class (``self.encode_text =
    partial(t5_encode_text, ...)``, ``self.text_encoder = T5EncoderModel.from_pretrained(...)``),
    indexed once per class."""
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
        return []
    cls = ctx.values.enclosing_class(func)
    if cls is None:
        return []
    index = ctx.facts.setdefault("_fact_self_attr_sources", {})
    if cls not in index:
        table: dict[str, list[ast.AST]] = {}
        for st in ast.walk(cls):
            if isinstance(st, ast.Assign):
                for t in st.targets:
                    if isinstance(t, ast.Attribute) and dotted(t.value) == "self":
                        table.setdefault(t.attr, []).append(st.value)
        index[cls] = table
    return index[cls].get(func.attr, [])


def t5_encoder(ctx: FileContext, node: ast.AST) -> str | None:
    """A call that runs a T5 encoder: a function or model whose name says T5, directly or
    through what ``self.<attr>`` was set to."""
    if not isinstance(node, ast.Call):
        return None
    names = [(ctx.call_name(node) or dotted(node.func) or "").rsplit(".", 1)[-1]]
    if _constructs(names[0]):
        return None
    for src in _self_attr_sources(ctx, node.func):
        names += names_in(src)
    hit = next((n for n in names if n and _T5_NAME.search(n) and "token" not in n.lower()), None)
    if hit is None:
        return None
    return f"`{ast.unparse(node.func)[:40]}(...)` runs a T5 encoder ({hit})"


_DECOMPOSITIONS = {f"torch.{n}" for n in (
    "svd", "linalg.svd", "linalg.svdvals", "linalg.eig", "linalg.eigh", "linalg.eigvals", "linalg.eigvalsh",
    "qr", "linalg.qr", "cholesky", "linalg.cholesky", "inverse", "linalg.inv", "linalg.solve", "linalg.lstsq",
    "det", "linalg.det", "logdet", "linalg.slogdet", "pinverse", "linalg.pinv")}
_PRODUCT_CALLS = ("einsum", "matmul", "bmm", "mm")


def _is_product(ctx: FileContext, expr: ast.AST) -> bool:
    """A matrix product (``a @ b``, ``torch.einsum``/einops' ``einsum``, ``matmul``), which
    autocast runs in low precision, anywhere in ``expr``."""
    return any((isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult))
               or (isinstance(n, ast.Call) and (ctx.call_name(n) or dotted(n.func) or "").rsplit(".", 1)[-1]
                   in _PRODUCT_CALLS) for n in ast.walk(expr))


def matrix_decomposition(ctx: FileContext, node: ast.AST) -> str | None:
    """A decomposition or inverse (``torch.svd``, ``torch.linalg.eigh``, ...) of a matrix product
    made in the same function and not cast to float32, in a ``forward`` or inside an autocast
    block: under autocast the product is half."""
    if not (isinstance(node, ast.Call) and node.args and (ctx.call_name(node) or "") in _DECOMPOSITIONS):
        return None
    scope = ctx.scope_of(node)
    if scope is None and getattr(ctx.enclosing_function(node), "name", "") != "forward":
        return None  # set-up code (an adapter's initialisation, a merge) runs outside the training autocast
    arg = node.args[0]
    if float32_result(ctx, arg):
        return None
    product = _is_product(ctx, arg)
    if not product and isinstance(arg, ast.Name):
        fn = ctx.enclosing_function(node)
        product = any(isinstance(st, ast.Assign) and st.lineno < node.lineno and _is_product(ctx, st.value)
                      and not float32_result(ctx, st.value)
                      and any(isinstance(t, ast.Name) and t.id == arg.id for t in st.targets) for st in ast.walk(fn))
    if not product:
        return None
    return f"`{ctx.call_name(node)}` of the matrix product `{ast.unparse(arg)[:40]}`"


@dataclass(frozen=True)
class SensitiveOp:
    """One row: what it is, how to spot it, the precisions it breaks in, and why."""

    what: str
    spot: Callable[[FileContext, ast.AST], str | None]
    breaks_in: tuple[str, ...]
    reason: str


SENSITIVE_OPS: tuple[SensitiveOp, ...] = (
    SensitiveOp("rotary positions", rotary_product, (BFLOAT16, FLOAT16),
                f"bfloat16 holds integers exactly only up to {EXACT_INTEGERS[BFLOAT16]} (float16 up to "
                f"{EXACT_INTEGERS[FLOAT16]}): larger positions "
                "are rounded, so neighbouring tokens get the same rotary angle"),
    SensitiveOp("spectral features", spectral_features, LOW_PRECISION_DTYPES,
                "power spectra pass float16's 65504 and the filterbank matmul runs in low precision "
                "(inf, then NaN after the log); cuFFT runs half precision only for power-of-two sizes"),
    SensitiveOp("matrix decomposition", matrix_decomposition, LOW_PRECISION_DTYPES,
                "autocast makes the product in low precision, and CUDA autocast hands the decomposition that "
                "half matrix (it has no float32 entry for it): torch's linear-algebra kernels take no "
                "float16/bfloat16 (an error). CPU autocast upcasts it, after the product was rounded to "
                "bfloat16's 8 significant bits, which moves small singular values and their vectors"),
    SensitiveOp("T5 encoder", t5_encoder, (FLOAT16,),
                "T5's feed-forward activations pass float16's 65504 (inf, then NaN); it is trained "
                "in bfloat16 or float32"),
)


def _runs_with_model(ctx: FileContext, node: ast.AST) -> bool:
    """In a function the model runs (not module level, not its construction) whose inputs no
    ``custom_fwd(cast_inputs=torch.float32)`` turns to float32 with autocast off."""
    fn = ctx.enclosing_function(node)
    if fn is ctx.tree or getattr(fn, "name", "") in ("__init__", "reset_parameters", "_init_weights"):
        return False
    return cast_inputs_dtype(ctx, fn) != "float32"


def _module_method(ctx: FileContext, node: ast.AST) -> bool:
    """In a method of an ``nn.Module`` subclass: model code, which its users' autocast reaches
    (a dataset's or a helper function's code may run outside it)."""
    cls = ctx.values.enclosing_class(node)
    return cls is not None and any((dotted(b) or "").endswith("Module") for b in cls.bases)


def _users_autocast(ctx: FileContext) -> set[str]:
    """The dtypes of the enabled autocasts of the modules that use this one ('unknown' when a
    library decides, as ``accelerator.autocast()``): this module's code runs under them."""
    key = "_fact_users_autocast"
    if key not in ctx.facts:
        ctx.facts[key] = {s.dtype for m in ctx.project.users_of(ctx) if m is not ctx
                         for s in m.autocast_scopes if s.enabled}
    return ctx.facts[key]


def _confidence(ctx: FileContext, node: ast.AST, op: SensitiveOp) -> tuple[Confidence, str] | None:
    """None when autocast is off here; else how sure we are that it runs in a breaking precision."""
    scope = ctx.scope_of(node)
    if scope is not None and not scope.enabled:
        return None
    if scope is not None and scope.dtype in op.breaks_in + ("unknown", None):
        return Confidence.HIGH, f" under autocast ({scope.dtype or 'its default dtype'})"
    if any(trains_in(ctx, d) for d in op.breaks_in):
        return Confidence.HIGH, " in a model trained in low precision"
    if _users_autocast(ctx) & set(op.breaks_in + ("unknown",)) and _module_method(ctx, node):
        return Confidence.HIGH, " (code that uses this module trains under autocast)"
    guarded = _guarded_elsewhere(ctx, op)
    if guarded:
        return Confidence.HIGH, guarded
    expects = expects_lowp_activations(ctx, op.breaks_in)
    if expects and _module_method(ctx, node):
        return Confidence.HIGH, expects
    if any(d in own_precisions(m) for m in ctx.project.program_modules(ctx) for d in op.breaks_in):
        return Confidence.MEDIUM, " (low-precision training elsewhere in the project)"
    if ctx.project_uses_amp:
        return Confidence.MEDIUM, " (code that uses this module trains under autocast)"
    if in_model_library(ctx):
        return Confidence.MEDIUM, LIBRARY_NOTE.format(why="under their autocast the op follows its dtype")
    return Confidence.LOW, " (no training seen; if this runs under autocast, the op follows its dtype)"


def _guarded_ops(ctx: FileContext) -> dict[str, ast.AST]:
    """The rows of SENSITIVE_OPS this module computes inside ``autocast(enabled=False)``, each
    with the first place it does."""
    key = "_fact_guarded_sensitive_ops"
    if key not in ctx.facts:
        found: dict[str, ast.AST] = {}
        for scope in ctx.autocast_scopes:
            region = scope.node
            while region is not None and not isinstance(region, (ast.With, ast.AsyncWith, ast.FunctionDef)):
                region = ctx.parents.get(region)
            if scope.enabled or region is None:
                continue
            for node in ast.walk(region):
                if isinstance(node, (ast.Call, ast.BinOp)):
                    for op in SENSITIVE_OPS:
                        if op.what not in found and op.spot(ctx, node) is not None:
                            found[op.what] = node
        ctx.facts[key] = found
    return ctx.facts[key]


def _guarded_elsewhere(ctx: FileContext, op: SensitiveOp) -> str | None:
    """A note naming where the project itself turns autocast off around the same computation:
    its authors know this code runs under autocast, and that this op breaks there."""
    for m in (ctx, *ctx.project.program_modules(ctx)):
        node = _guarded_ops(m).get(op.what)
        if node is not None:
            where = "" if m is ctx else f"{Path(m.path).name}:"
            return f" (the project turns autocast off around the same computation at {where}{node.lineno})"
    return None


@declare_rule(
    "AMP020", "sensitive-op-under-autocast", Severity.MEDIUM,
    explanation=("Some computations are known to break in autocast's low precision although autocast runs "
                 "them there: rotary angles from large positions, spectral features, T5 encoders in float16."),
    suggestion=("Wrap the computation in `with torch.autocast(device_type, enabled=False):` and give it "
                "float32 inputs (x.float()); cast the result back if the model needs it."))
class SensitiveOpUnderAutocast(RuleVisitor):
    """Each row of SENSITIVE_OPS where the model's code computes it without turning autocast off."""

    def run(self):
        ctx = self.ctx
        seen: set[tuple[ast.AST, str]] = set()
        nodes = [n for n in ctx.nodes if isinstance(n, (ast.Call, ast.BinOp))]
        for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
            for op in SENSITIVE_OPS:
                said = op.spot(ctx, node)
                if said is None or not _runs_with_model(ctx, node):
                    continue
                judged = _confidence(ctx, node, op)
                where = (ctx.enclosing_function(node), op.what)
                if judged is not None and where not in seen:
                    seen.add(where)
                    self.report(node, f"{op.what}: {said}{judged[1]}; {op.reason}", judged[0])
                break
        return self.hits


RULES: tuple[Rule, ...] = (SensitiveOpUnderAutocast.rule,)
