"""The run-time precision audit's rules: one row each (id, name, severity, why, fix, and the
function that reads the record), judged after the audited steps.

A finding about an object's configuration stands at the line the user changes: where the optimizer
or GradScaler was built, the model cast or the autocast region entered (when the audit saw it,
:mod:`training_profiler.audit.source`); its message names where it ran. Hand-written parameter
updates are judged for lost updates as optimizer steps are (:mod:`training_profiler.audit.updates`).

Each rule judges what ran, with one allowance: under autocast, an op that CUDA's autocast runs in
float32 (softmax, log_softmax, cross-entropy's parts, sum, cumsum, norm, the losses) is not
reported when it ran in a low precision, since only the CPU's autocast leaves it there and the
same code on a GPU is fine. Thresholds read the dtype's limits from ``quant.analysis`` (the one
definition of overflow / underflow); findings are the static checker's ``Finding``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from quant.analysis import SEVERITY_HIGH, dtype_limits, severity
from quant.vocabulary import LOW_PRECISION_DTYPES, Severity
from training_profiler.audit.record import FunctionCall, OpSite, Record, StepEvent
from training_profiler.audit.source import Where, place
from training_profiler.audit.updates import ManualUpdate
from training_profiler.findings_report import Confidence, Finding

#: fraction of float16's max_normal at which a value is reported as about to overflow
NEAR_MAX = 0.9
#: fraction of a step's low-precision gradient elements at zero or below min_normal
FLUSHED_GRADS = 0.5
#: fraction of low-precision parameter elements, with a nonzero gradient, that a step left as is
STUCK_PARAMS = 0.1

#: ops computing a loss or log-probabilities (aten names, after decomposition)
LOSS_OPS = frozenset({"_log_softmax", "nll_loss_forward", "nll_loss2d_forward", "binary_cross_entropy",
                      "binary_cross_entropy_with_logits", "kl_div", "mse_loss", "l1_loss",
                      "smooth_l1_loss", "huber_loss", "soft_margin_loss", "log_sigmoid_forward",
                      "logsumexp"})
#: ops that accumulate many values into few
REDUCTION_OPS = frozenset({"sum", "mean", "linalg_vector_norm", "norm", "cumsum", "cumprod", "prod",
                           "_softmax", "var", "std", "var_mean", "std_mean", "nansum"})
#: ops CUDA autocast runs in float32 (its fp32 list and the reductions it upcasts)
CUDA_AUTOCAST_FP32 = frozenset({"_log_softmax", "_softmax", "sum", "cumsum", "cumprod", "prod",
                                "linalg_vector_norm", "norm", "logsumexp", "nll_loss_forward",
                                "nll_loss2d_forward", "kl_div", "mse_loss", "l1_loss", "smooth_l1_loss",
                                "huber_loss", "soft_margin_loss", "binary_cross_entropy_with_logits"})
_WIDTH = {"float64": 3, "float32": 2, "float16": 1, "bfloat16": 1}

Hit = tuple[Where, str]


@dataclass(frozen=True)
class AuditRule:
    id: str
    name: str
    severity: Severity
    explanation: str
    suggestion: str
    judge: Callable[[Record], Iterator[Hit]]


def _lowp_in(site: OpSite) -> str | None:
    return next((d for d in site.in_dtypes if d in LOW_PRECISION_DTYPES), None)


def _autocast_upcasts(site: OpSite) -> bool:
    return site.autocast is not None and site.op in CUDA_AUTOCAST_FP32


def _entered(autocast: str | None, at: Where | None, seen_from: Where) -> str:
    if not autocast:
        return ", autocast off"
    return f", autocast {autocast}" + (f" entered at {place(at, seen_from)}" if at else "")


def _at(site: OpSite) -> str:
    mod = f" in {site.module}" if site.module else ""
    ac = _entered(site.autocast, site.autocast_at, site.where)
    return f"{mod} ({site.calls} call{'s' if site.calls != 1 else ''}{ac})"


def _located(anchors: Sequence[tuple[str, Where | None]]) -> tuple[Where, str]:
    """The finding's line, the first known of ``anchors`` (ordered by where the user fixes it:
    the object's construction, the model's cast, the region's entry, then where it ran), and a
    message suffix naming the other known ones from there."""
    known = [(what, w) for what, w in anchors if w is not None]
    where = known[0][1]
    others = [f"{what} {place(w, where)}" for what, w in known if w != where]
    return where, f" ({', '.join(others)})" if others else ""


def _cast(casts: dict[Where, str], dtypes: Sequence[str] = LOW_PRECISION_DTYPES) -> tuple[str, Where | None]:
    """The first line that cast these parameters to one of ``dtypes``, as an anchor."""
    found = next(((w, d) for w, d in casts.items() if d in dtypes), None)
    return (f"parameters cast to {found[1]} at", found[0]) if found else ("", None)


def _forward(rec: Record) -> Iterator[OpSite]:
    return (s for s in rec.sites.values() if s.phase == "forward")


def _lowp_loss(rec: Record) -> Iterator[Hit]:
    for s in _forward(rec):
        d = _lowp_in(s)
        if s.op in LOSS_OPS and d and not _autocast_upcasts(s):
            yield s.where, f"{s.op} ran on {d} inputs{_at(s)}"


def _lowp_reduction(rec: Record) -> Iterator[Hit]:
    """Only with autocast off: under autocast, a reduction it leaves in low precision (mean,
    a pooling) is its policy, kept by every AMP training; the bugs are tensors made low
    precision by hand (a .half() model, an autocast-disabled region fed low-precision input)."""
    for s in _forward(rec):
        d = next((o for o in s.out_dtypes if o in LOW_PRECISION_DTYPES), None)
        if s.op in REDUCTION_OPS and d and _lowp_in(s) and s.reduced > 1 and s.autocast is None:
            yield s.where, f"{s.op} accumulated {s.reduced} values into {d}{_at(s)}"


def _near_fp16_max(rec: Record) -> Iterator[Hit]:
    top = dtype_limits(torch.float16).max_normal
    for s in _forward(rec):
        if "float16" in s.out_dtypes and s.absmax >= NEAR_MAX * top:
            what = "overflowed to Inf" if s.saturated > 0 else f"reached {s.absmax:.6g}"
            yield s.where, f"{s.op}'s float16 output {what} (float16 max {top:g}){_at(s)}"


def _flushed_grads(rec: Record) -> Iterator[Hit]:
    """Zeros alone are no evidence (an embedding's unused rows): the nonzero gradients must
    also show underflow under way, a subnormal fraction of quant.analysis's 'high' severity."""
    for ev in rec.steps:
        nonzero = ev.lowp_grad_elems - ev.lowp_grad_flushed + ev.lowp_grad_subnormal
        if not (nonzero and severity(ev.lowp_grad_subnormal / nonzero) == SEVERITY_HIGH):
            continue
        if ev.lowp_grad_flushed / ev.lowp_grad_elems > FLUSHED_GRADS:
            frac = ev.lowp_grad_flushed / ev.lowp_grad_elems
            where, also = _located([("stepped at", ev.where), _cast(ev.casts)])
            yield where, (f"{frac:.0%} of the {'/'.join(sorted(ev.grad_dtypes & set(LOW_PRECISION_DTYPES)))} "
                          f"gradients reaching {ev.optimizer}.step are zero or below min_normal{also}")


def _fp16_optimizer_state(rec: Record) -> Iterator[Hit]:
    lim = dtype_limits(torch.float16)
    for ev in rec.steps:
        if ev.fp16_states:
            tiny = [e for e in ev.eps if 0 < e < lim.min_subnormal]
            eps = f"; eps {tiny[0]:g} is below float16's smallest step {lim.min_subnormal:.3g}" if tiny else ""
            where, also = _located([(f"{ev.optimizer} built at", ev.built), ("stepped at", ev.where),
                                    _cast(ev.casts, ("float16",))])
            yield where, f"{ev.optimizer} keeps {', '.join(ev.fp16_states)} in float16{eps}{also}"


def _no_master_weights(rec: Record) -> Iterator[Hit]:
    """Optimizer steps and hand-written updates alike; at the model's cast when it was seen."""
    for ev in rec.steps:
        if ev.moved_elems and ev.stuck_elems / ev.moved_elems > STUCK_PARAMS:
            yield _lost_updates(ev, f"{ev.optimizer}.step", "with a nonzero gradient",
                                [(f"{ev.optimizer} built at", ev.built), ("stepped at", ev.where)])
    for up in rec.updates.values():
        if up.moved_elems and up.stuck_elems / up.moved_elems > STUCK_PARAMS:
            yield _lost_updates(up, f"the hand-written update {up.op}", "that it moves in float32",
                                [("updated at", up.where)])


def _lost_updates(ev: StepEvent | ManualUpdate, who: str, which: str,
                  ran: list[tuple[str, Where | None]]) -> Hit:
    dtypes = ev.lowp_param_dtypes if isinstance(ev, StepEvent) else ev.param_dtypes
    where, also = _located([_cast(ev.casts), *ran])
    return where, (f"{who} left {ev.stuck_elems / ev.moved_elems:.0%} of the {'/'.join(sorted(dtypes))} "
                   f"parameter elements {which} unchanged (update below half an ulp){also}")


def _fp16_seen(rec: Record) -> Where | None:
    for ev in rec.steps:
        if "float16" in ev.grad_dtypes:
            return ev.where
    for s in rec.sites.values():
        if s.phase == "backward" and "float16" in s.out_dtypes:
            return s.where
    return None


def _fp16_origins(rec: Record) -> list[tuple[str, Where | None]]:
    """Where the float16 came from, as anchors: an autocast float16 region's entry, a cast of
    stepped parameters to float16."""
    region = next((s.autocast_at for s in _forward(rec) if s.autocast == "float16" and s.autocast_at), None)
    cast = next((c for ev in rec.steps if (c := _cast(ev.casts, ("float16",)))[1]), ("", None))
    return [("autocast float16 entered at", region), cast]


def _scaler_missing(rec: Record) -> Iterator[Hit]:
    ran = _fp16_seen(rec)
    if ran is not None and not any(enabled for _, enabled, _ in rec.scaler_calls):
        where, also = _located([*_fp16_origins(rec), ("float16 gradients at", ran)])
        yield where, f"gradients are computed in float16 and no enabled GradScaler scales the loss{also}"


def _scaler_unneeded(rec: Record) -> Iterator[Hit]:
    enabled = [(site, built) for site, on, built in rec.scaler_calls if on]
    fp16 = _fp16_seen(rec) or any("float16" in s.out_dtypes for s in rec.sites.values())
    if enabled and not fp16:
        where, also = _located([("GradScaler built at", enabled[0][1]), ("scaling at", enabled[0][0])])
        yield where, ("GradScaler scales the loss but nothing ran in float16 (bfloat16 / float32 "
                      f"need no loss scaling){also}")


def _function_dtype(rec: Record) -> Iterator[Hit]:
    for f in rec.functions.values():
        if _function_changes_dtype(f):
            ac = f"{_entered(f.autocast, f.autocast_at, f.where)} and no custom_fwd" if f.autocast else ""
            yield f.where, (f"autograd Function {f.name} returned {'/'.join(sorted(set(f.out_dtypes)))} "
                            f"for {'/'.join(sorted(set(f.in_dtypes)))} inputs{ac}")


def _function_changes_dtype(f: FunctionCall) -> bool:
    new = set(f.out_dtypes) - set(f.in_dtypes)
    if not new:
        return False
    if f.autocast and not f.custom_fwd:
        return True
    narrowest = min(_WIDTH.get(d, 2) for d in f.in_dtypes)
    return any(_WIDTH.get(d, 2) <= narrowest for d in new)


def _bce_under_autocast(rec: Record) -> Iterator[Hit]:
    for s in _forward(rec):
        if s.op == "binary_cross_entropy" and s.autocast:
            yield s.where, f"binary_cross_entropy ran under autocast{_at(s)}"


RULES: tuple[AuditRule, ...] = (
    AuditRule("AUD001", "loss-on-lowp-logits", Severity.HIGH,
              "a loss or log-probabilities computed from float16/bfloat16 logits loses the small "
              "probability differences training and PPO/KL ratios depend on (8 or 11 bits of mantissa)",
              "upcast first: loss_fn(logits.float(), target) / log_softmax(logits.float(), -1)", _lowp_loss),
    AuditRule("AUD002", "lowp-reduction", Severity.MEDIUM,
              "a sum/mean/norm/cumsum/softmax whose result is float16/bfloat16 rounds every partial "
              "result to 8-11 bits and overflows float16 at 65504",
              "pass dtype=torch.float32 (x.sum(dtype=torch.float32), softmax(x, -1, dtype=torch.float32)) "
              "or upcast the input", _lowp_reduction),
    AuditRule("AUD003", "near-fp16-max", Severity.HIGH,
              "float16 values within 10% of its max (65504) overflow to Inf at the next growth "
              "(a larger batch, a later step, a residual add)",
              "compute this op in float32 or bfloat16, or rescale its input (e.g. scale q before q@k^T)",
              _near_fp16_max),
    AuditRule("AUD004", "grads-flushed", Severity.HIGH,
              "most gradients are zero or below their dtype's min_normal: updates are lost to underflow",
              "scale the loss (torch.amp.GradScaler) or keep gradients in float32", _flushed_grads),
    AuditRule("AUD005", "fp16-optimizer-state", Severity.HIGH,
              "optimizer moments in float16 underflow (exp_avg_sq ~ grad^2) and an eps below float16's "
              "smallest step rounds to 0, so the update divides by ~0",
              "keep optimizer states in float32 (optimize fp32 master parameters)", _fp16_optimizer_state),
    AuditRule("AUD006", "no-master-weights", Severity.HIGH,
              "parameters stepped in float16/bfloat16 drop every update below half an ulp of the "
              "weight: training stalls silently",
              "keep float32 master weights (autocast over a float32 model, or a master copy the "
              "optimizer steps)", _no_master_weights),
    AuditRule("AUD007", "gradscaler-missing", Severity.HIGH,
              "float16 gradients without loss scaling underflow to zero",
              "wrap the backward with torch.amp.GradScaler: scaler.scale(loss).backward(); "
              "scaler.step(opt); scaler.update()", _scaler_missing),
    AuditRule("AUD008", "gradscaler-unneeded", Severity.LOW,
              "bfloat16 has float32's range: loss scaling only adds skipped steps and a state to checkpoint",
              "drop the GradScaler (or enable it only for float16)", _scaler_unneeded),
    AuditRule("AUD009", "autograd-function-dtype", Severity.MEDIUM,
              "a custom autograd Function returning a dtype its inputs did not have: autocast does not "
              "see inside it and its backward runs outside autocast with mismatched dtypes",
              "decorate forward/backward with torch.amp.custom_fwd / custom_bwd, or cast the output "
              "back to the input's dtype", _function_dtype),
    AuditRule("AUD010", "bce-under-autocast", Severity.HIGH,
              "binary_cross_entropy is unsafe under autocast (CUDA autocast raises on it)",
              "use binary_cross_entropy_with_logits on the logits", _bce_under_autocast),
)
RULES_BY_ID = {r.id: r for r in RULES}


def judge(rec: Record) -> list[Finding]:
    """The findings of every row of :data:`RULES` over a record, one per rule and source line,
    in rule order (a new rule is one row there: docs/architecture.md, "A run-time audit rule")."""
    out: dict[tuple, Finding] = {}
    for rule in RULES:
        for where, message in rule.judge(rec):
            key = (rule.id, where.path, where.line)
            if key not in out:
                out[key] = Finding(rule.id, rule.severity, where.path, where.line, 0, message,
                                   rule.explanation, rule.suggestion, Confidence.HIGH)
    return list(out.values())
