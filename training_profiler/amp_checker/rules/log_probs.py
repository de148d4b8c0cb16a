"""AMP032: log-probabilities taken from a model's logits in the model's own low precision.

A model whose weights are themselves bfloat16 or float16 (``from_pretrained(torch_dtype=
torch.bfloat16)``, ``model.half()``, a DeepSpeed ``"bf16": {"enabled": ...}`` section) returns
logits in that dtype, and nothing upcasts them the way autocast would. ``log_softmax``,
``cross_entropy``, ``logsigmoid`` and ``logsumexp`` on them return log-probabilities with 8 bits
of mantissa (bfloat16): a token's log-probability of -10 is only known to about 0.06, so a PPO
ratio ``exp(logp - old_logp)`` or a KL estimate built from two of them is mostly rounding, and a
language-model loss is biased (OpenRLHF's actor and collie's ``GPTLMLoss``, both fixed by
``logits.float()``). Autocast would have computed ``log_softmax``/``cross_entropy`` in float32,
so the rule wants weights made low precision, not autocast.
"""
from __future__ import annotations

import ast
import re

from quant.vocabulary import LOW_PRECISION_DTYPES, Severity
from training_profiler.amp_checker import values as av
from training_profiler.amp_checker.context import FileContext, dotted
from training_profiler.amp_checker.intent import per_module, training_lowp_casts
from training_profiler.amp_checker.precision import loaded_lowp_models
from training_profiler.amp_checker.rules.base import Confidence, Rule, RuleVisitor, declare_rule
from training_profiler.amp_checker.rules.helpers import (
    assigned_values,
    names_in,
    test_module,
    upcast_in,
)

#: the log-domain ops -> whether CUDA autocast runs them in float32 (so autocast protects them)
LOG_PROB_OPS = {"log_softmax": True, "cross_entropy": True, "logsumexp": True, "logsigmoid": False}
_TENSOR_METHODS = ("log_softmax", "logsumexp")
_CROSS_ENTROPY_MODULES = ("CrossEntropyLoss",)
_LOGITS = re.compile(r"logit|reward", re.I)
_LOG_PROBS = re.compile(r"logp|log_prob|logprob|lprob|log_?ratio", re.I)
_MODEL_WORDS = re.compile(r"model|net|module|actor|critic|policy|transformer|unet|encoder|decoder", re.I)
_WEIGHT_WORDS = re.compile(r"weight|param|model", re.I)
_TESTED = "a weight's dtype tested for low precision"
_DEEPSPEED_SECTIONS = ("bf16", "bfloat16", "fp16")  # a DeepSpeed config's precision sections


def _log_prob_op(ctx: FileContext, call: ast.Call) -> tuple[str, ast.AST] | None:
    """(op, operand) for a log-domain op without ``dtype=``: ``F.log_softmax(x)``,
    ``x.log_softmax(-1)``, ``F.cross_entropy(x, y)``, ``self.loss_fn(x, y)`` bound to an
    ``nn.CrossEntropyLoss``."""
    if any(k.arg == "dtype" for k in call.keywords):
        return None
    q = ctx.qualname(call.func) or ""
    last = (q or dotted(call.func) or "").rsplit(".", 1)[-1]
    if last in LOG_PROB_OPS and q.startswith("torch."):
        given = [*call.args[:1], *(k.value for k in call.keywords if k.arg in ("input", "logits"))]
        return (last, given[0]) if given else None
    if last in _TENSOR_METHODS and isinstance(call.func, ast.Attribute) \
            and (dotted(call.func.value) or "").split(".")[0] not in ctx.aliases:  # x.log_softmax(dim=-1)
        return last, call.func.value
    if call.args and _logits_in(call.args[0]) and any(
            v.kind == av.LOSS_FN and v.name.rsplit(".", 1)[-1] in _CROSS_ENTROPY_MODULES
            for v in ctx.values.value(call.func)):
        return "cross_entropy", call.args[0]
    return None


def _reaching(ctx: FileContext, fn: ast.AST, expr: ast.AST, depth: int = 3) -> list[str]:
    """Every name ``expr`` is made of, and (within ``depth`` assignments in ``fn``) the names its
    local names were made of: ``chosen_scores`` -> ``chosen_rewards`` -> ``values``."""
    out: list[str] = []
    frontier = [expr]
    for level in range(depth + 1):
        out += [t for e in frontier for n in ast.walk(e) if (t := _text(n))]
        if level == depth:
            break
        frontier = [v for v in assigned_values(ctx, fn, _local_names(frontier)) if v not in frontier]
    return out


def _local_names(exprs: list[ast.AST]) -> set[str]:
    return {n.id for e in exprs for n in ast.walk(e) if isinstance(n, ast.Name)}


def _text(n: ast.AST) -> str:
    return n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else \
        n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else ""


def _logits_in(expr: ast.AST, ctx: FileContext | None = None, fn: ast.AST | None = None) -> str | None:
    """The name that says ``expr`` is a model's logits or scores (``shift_logits``,
    ``out["logits"]``, ``chosen_rewards``), followed through ``fn``'s assignments; None when it
    was made from log-probabilities (a DPO log-ratio named ``logits``: their precision was
    decided where the log-probabilities were)."""
    texts = _reaching(ctx, fn, expr) if fn is not None and ctx is not None \
        else [t for n in ast.walk(expr) if (t := _text(n))]
    if any(_LOG_PROBS.search(t) for t in texts):
        return None
    return next((t for t in texts if _LOGITS.search(t)), None)


def _upcast_before(ctx: FileContext, fn: ast.AST, expr: ast.AST, depth: int = 4) -> bool:
    """``expr`` is upcast, or a name in it was made, within ``depth`` assignments in its function,
    from an upcast (``logits = logits.float()``; ``diff = ref - model_losses`` with
    ``model_losses = F.mse_loss(pred.float(), ...)``)."""
    if upcast_in(ctx, expr):
        return True
    return depth > 0 and any(_upcast_before(ctx, fn, v, depth - 1)
                             for v in assigned_values(ctx, fn, _local_names([expr])) if v is not expr)


def _callers_upcast(ctx: FileContext, fn: ast.AST, expr: ast.AST) -> bool:
    """``expr`` is made from a parameter of ``fn`` and every call of ``fn`` in the project hands
    it an upcast value (``get_batch_logps(model(**batch).logits.float(), labels)``)."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    params = [a.arg for a in fn.args.args]
    used = set(_reaching(ctx, fn, expr)) & set(params)
    sites = ctx.project.calls_to(fn, ctx) if used else []
    if not sites:
        return False
    offset = 1 if params[:1] in (["self"], ["cls"]) else 0
    for call, caller_ctx in sites:
        given = {params[i + offset]: a for i, a in enumerate(call.args) if i + offset < len(params)}
        given |= {k.arg: k.value for k in call.keywords if k.arg}
        caller = caller_ctx.enclosing_function(call)
        if not all(p in given and _upcast_before(caller_ctx, caller, given[p]) for p in used):
            return False
    return True


def _deepspeed_section(m: FileContext) -> str | None:
    """A DeepSpeed config's ``"bf16": {"enabled": ...}`` section (a dict literal, or assigned
    to ``config["bf16"]``): ZeRO then runs the model in that dtype, autocast does not."""
    for n in m.nodes:
        pairs: list[tuple[ast.AST | None, ast.AST]] = []
        if isinstance(n, ast.Dict):
            pairs = list(zip(n.keys, n.values))
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict):
            pairs = [(t.slice, n.value) for t in n.targets if isinstance(t, ast.Subscript)]
        for key, value in pairs:
            if isinstance(key, ast.Constant) and key.value in _DEEPSPEED_SECTIONS and isinstance(value, ast.Dict) \
                    and any(isinstance(k, ast.Constant) and k.value == "enabled" for k in value.keys):
                return f"a DeepSpeed \"{key.value}\" section at {m.path.rsplit('/', 1)[-1]}:{n.lineno}"
    return None


@per_module
def _lowp_weights_here(m: FileContext) -> str | None:
    """A model made low precision in ``m``: loaded so, cast so for training (a receiver that
    names a model, not a batch), or a DeepSpeed precision section; a test file says nothing."""
    if test_module(m):
        return None
    where = m.path.rsplit("/", 1)[-1]
    for call, dtype in loaded_lowp_models(m):
        return f"a model loaded in {dtype} at {where}:{call.lineno}"
    for call in training_lowp_casts(m):
        if isinstance(call.func, ast.Attribute) and _MODEL_WORDS.search(" ".join(names_in(call.func.value))):
            return f"`{ast.unparse(call)[:40]}` at {where}:{call.lineno}"
    return _deepspeed_section(m) or _weights_tested_for_lowp(m)


def _weights_tested_for_lowp(m: FileContext) -> str | None:
    """Code that tests a weight's dtype for bfloat16/float16 (``if self.weight.dtype in
    [torch.float16, torch.bfloat16]:``) is written for low-precision weights."""
    for n in m.nodes:
        if not isinstance(n, ast.Compare):
            continue
        sides = [n.left, *n.comparators]
        dtypes = {m.literal_dtype(e) for s in sides for e in ([*s.elts] if isinstance(s, (ast.List, ast.Tuple, ast.Set))
                                                              else [s])}
        if dtypes & set(LOW_PRECISION_DTYPES) and any(
                isinstance(s, ast.Attribute) and s.attr == "dtype" and _WEIGHT_WORDS.search(" ".join(names_in(s.value)))
                for s in sides):
            return f"{_TESTED} at {m.path.rsplit('/', 1)[-1]}:{n.lineno}"
    return None


@per_module
def lowp_weights(ctx: FileContext) -> str | None:
    """Where ``ctx`` or a module next to it (``Project.neighbours_of``: what it imports, what
    imports it) makes a model's weights low precision, or None. Not its whole package: a
    library's example script that loads a model in bfloat16 says nothing of its trainers."""
    return next((w for m in ctx.project.neighbours_of(ctx) if (w := _lowp_weights_here(m))), None)


def _confidence(ctx: FileContext, evidence: str) -> tuple[Confidence, str]:
    """HIGH where the program makes weights low precision and runs no autocast that could cover
    the op; MEDIUM where it also uses autocast, or where its only evidence is a dtype test (code
    written to allow low-precision weights, not a run that makes them)."""
    if evidence.startswith(_TESTED):
        return Confidence.MEDIUM, ""
    if any(s.enabled for m in ctx.project.program_of(ctx) for s in m.autocast_scopes):
        return Confidence.MEDIUM, " (the program also uses autocast, which may cover it)"
    return Confidence.HIGH, ""


def _helper_log_prob(ctx: FileContext, call: ast.Call) -> tuple[str, str] | None:
    """(op, helper name) when ``call`` hands logits to a project function that takes a log-domain
    op of that parameter in its own dtype (``log_probs_from_logits(out["logits"], labels)``)."""
    named = [i for i, a in enumerate(call.args) if _logits_in(a)]
    if not named:
        return None
    caller = ctx.enclosing_function(call)
    for v in ctx.values.value(call.func):
        fn, mod = v.node, v.ctx
        if v.kind != av.FUNCTION or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or mod is None:
            continue
        params = [a.arg for a in fn.args.args if a.arg not in ("self", "cls")]
        taken = _param_log_probs(mod, fn)
        for i in named:
            if i < len(params) and params[i] in taken and _logits_in(call.args[i], ctx, caller) \
                    and not _upcast_before(ctx, caller, call.args[i]):
                return taken[params[i]], fn.name
    return None


def _param_log_probs(mod: FileContext, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str]:
    """Parameter -> the log-domain op ``fn`` takes of it in its own dtype; once per function."""
    cache = mod.facts.setdefault("_fact_param_log_probs", {})
    if fn not in cache:
        params = {a.arg for a in fn.args.args}
        cache[fn] = {}
        for inner in ast.walk(fn):
            found = isinstance(inner, ast.Call) and _log_prob_op(mod, inner)
            if found and not _upcast_before(mod, fn, found[1]):
                for name in {n.id for n in ast.walk(found[1]) if isinstance(n, ast.Name)} & params:
                    cache[fn].setdefault(name, found[0])
    return cache[fn]


@declare_rule(
    "AMP032", "logprobs-on-low-precision-logits", Severity.MEDIUM, training_path=True,
    explanation=("Log-probabilities (log_softmax, cross_entropy, logsigmoid, logsumexp) of a model's logits or scores "
                 "in the model's own dtype, where the program makes the model's weights bfloat16 or float16: the "
                 "log-probabilities keep 8 (bfloat16) or 11 bits, so a loss, a PPO ratio or a KL estimate built "
                 "from them is dominated by rounding; autocast would have computed them in float32."),
    suggestion="Upcast first: F.log_softmax(logits.float(), dim=-1), F.cross_entropy(logits.float(), labels).")
class LogProbsOnLowPrecisionLogits(RuleVisitor):
    """A log-domain op without ``dtype=`` on an operand that names logits (or a call handing
    logits to a project function that takes one of its parameter), with no upcast on the way,
    in a program that makes a model's weights low precision (``lowp_weights``). HIGH where the
    module uses no autocast; MEDIUM where it does (a caller's autocast may cover the op); not
    under an enabled autocast for the ops autocast runs in float32. No finding where no
    low-precision weights are seen: logits are then float32 or autocast's."""

    def run(self):
        ctx = self.ctx
        if not any(_LOGITS.search(_text(n)) for n in ctx.nodes) or (evidence := lowp_weights(ctx)) is None:
            return self.hits
        for call in ctx.calls:
            fn = ctx.enclosing_function(call)
            found = _log_prob_op(ctx, call)
            if found is not None:
                op, operand = found
                if not (named := _logits_in(operand, ctx, fn)) or _upcast_before(ctx, fn, operand) \
                        or _callers_upcast(ctx, fn, operand):
                    continue
                what = f"{op} of `{named}` in the model output's own dtype"
            elif (through := _helper_log_prob(ctx, call)) is not None:
                op, helper = through
                what = f"logits handed to {helper}(), which takes their {op} in their own dtype"
            else:
                continue
            if LOG_PROB_OPS[op] and ctx.in_autocast(call):
                continue
            conf, note = _confidence(ctx, evidence)
            self.report(call, f"{what}: the model's weights are low precision ({evidence}), so the "
                              f"log-probabilities keep a few bits{note}", conf)
        return self.hits


RULES: tuple[Rule, ...] = (LogProbsOnLowPrecisionLogits.rule,)
