"""The static AMP checker's rules: one module per family, each rule declared on its visitor.

The rules follow PyTorch's automatic-mixed-precision documentation: which ops autocast runs in
float32 and which in low precision, what autocast refuses (binary_cross_entropy on CUDA), the
GradScaler workflow (unscale before clipping), and the deprecated ``torch.cuda.amp`` names.
Each visitor only reports; filtering (suppression comments, rule selection) happens in
``checker``.

A family module holds its visitors, each under ``@declare_rule(id, name, severity,
explanation=..., suggestion=...)`` (``base``), and ends with ``RULES``, the rules it declares.
Helpers two or more families ask live in ``helpers``.

``RULES`` is every rule of ``FAMILIES`` and ``BUG_KIND_RULES`` every rule of
``BUG_KIND_FAMILIES``, each in rule-id order whatever module declares a rule: the order the
checker runs the rules (their visitors fill a module's shared caches in that order), lists them
(``--list-rules``, ``--help``) and reports findings that tie on a position. The bug-kind rules
cover bugs public projects fixed and each has a golden file and a clean twin.
``training_profiler.amp_checker.catalog`` chains the extension visitors onto these and is the table the
checker runs.
"""
from __future__ import annotations

from training_profiler.amp_checker.intent import training_lowp_casts, trains
from training_profiler.amp_checker.rules import (
    autocast_scope,
    autograd_function,
    averages,
    casts,
    checkpoint,
    consistency,
    deprecated,
    disabled_autocast,
    dtype_mix,
    grad_norms,
    grad_scaler,
    log_domain,
    log_probs,
    long_reduction,
    manual_scaling,
    numerics,
    positions,
    reductions,
    scaler_alone,
    sensitive_ops,
    sharding,
)
from training_profiler.amp_checker.rules.autocast_scope import (
    AutocastWrappedForward,
    BackwardInAutocast,
    BceUnderAutocast,
    EvalLossOutsideAutocast,
    LossOutsideAutocast,
)
from training_profiler.amp_checker.rules.autograd_function import (
    AutogradFunctionNoCustomFwd,
    Float32BufferForKernel,
    PartialDtypeCasts,
)
from training_profiler.amp_checker.rules.averages import (
    AverageCopyCastToLowp,
    AverageInParameterDtype,
)
from training_profiler.amp_checker.rules.base import (
    NO_TRAINING_NOTE,
    Confidence,
    Finding,
    Rule,
    RuleVisitor,
    declare_rule,
)
from training_profiler.amp_checker.rules.casts import (
    Float16ChosenOnBf16Path,
    Float16OverBf16Option,
    ManualCast,
)
from training_profiler.amp_checker.rules.checkpoint import (
    ScalerSaveNeverRuns,
    ScalerStateNotCheckpointed,
)
from training_profiler.amp_checker.rules.consistency import (
    DtypeMatchUndone,
    LayersOnUpcastInputElsewhere,
    UpcastSkippedHere,
)
from training_profiler.amp_checker.rules.deprecated import DeprecatedAmpApi
from training_profiler.amp_checker.rules.disabled_autocast import AutocastOffWithoutUpcast
from training_profiler.amp_checker.rules.dtype_mix import (
    BatchIntoLowpModel,
    CacheKeyedWithoutDtype,
    Float32BesideActivations,
    StaleCopyWrittenBack,
)
from training_profiler.amp_checker.rules.grad_norms import GradNormInLowPrecision
from training_profiler.amp_checker.rules.grad_scaler import (
    ClipWithoutUnscale,
    Fp16WithoutGradScaler,
    GradScalerWithBf16,
    GradsChangedBeforeUnscale,
    OptimizerStepAroundScaler,
    UnscaleEveryMicroStep,
)
from training_profiler.amp_checker.rules.helpers import (
    FP16_MAX,
    FP16_MIN_NORMAL,
    FP16_MIN_SUBNORMAL,
)
from training_profiler.amp_checker.rules.log_domain import LogUnderflowFp16
from training_profiler.amp_checker.rules.log_probs import LogProbsOnLowPrecisionLogits
from training_profiler.amp_checker.rules.long_reduction import LinearAttentionSum
from training_profiler.amp_checker.rules.manual_scaling import PartialManualUnscale
from training_profiler.amp_checker.rules.numerics import (
    EpsAgainstParameters,
    EpsUnderflowFp16,
    Fp16UnsafeConstant,
    MaskConstantAgainstTraining,
    NormStatsInInputPrecision,
)
from training_profiler.amp_checker.rules.positions import RotaryAnglesInLowPrecision
from training_profiler.amp_checker.rules.reductions import (
    ReductionOutsideAutocast,
    SoftmaxNoDtype,
    UnusedUpcastSoftmax,
)
from training_profiler.amp_checker.rules.scaler_alone import GradScalerWithoutAutocast
from training_profiler.amp_checker.rules.sensitive_ops import (
    SENSITIVE_OPS,
    SensitiveOpUnderAutocast,
)
from training_profiler.amp_checker.rules.sharding import GradScalerNotSharded

FAMILIES = (casts, autocast_scope, reductions, autograd_function, deprecated, grad_scaler, numerics)
BUG_KIND_FAMILIES = (checkpoint, long_reduction, sensitive_ops, dtype_mix, manual_scaling, consistency, averages,
                     positions, sharding, disabled_autocast, grad_norms,
                     scaler_alone, log_domain, log_probs)


def _in_id_order(families: tuple) -> tuple[Rule, ...]:
    rules = sorted((r for family in families for r in family.RULES), key=lambda r: r.id)
    ids = [r.id for r in rules]
    if len(set(ids)) != len(ids):
        raise ValueError(f"two AMP rules share an id: {sorted(i for i in ids if ids.count(i) > 1)}")
    return tuple(rules)


RULES: tuple[Rule, ...] = _in_id_order(FAMILIES)
BUG_KIND_RULES: tuple[Rule, ...] = _in_id_order(BUG_KIND_FAMILIES)
RULES_BY_ID = {r.id: r for r in RULES}
RULES_BY_NAME = {r.name: r for r in RULES}

__all__ = [
    "RULES", "RULES_BY_ID", "RULES_BY_NAME", "BUG_KIND_RULES", "FAMILIES", "BUG_KIND_FAMILIES",
    "Confidence", "Finding", "Rule", "RuleVisitor", "declare_rule", "NO_TRAINING_NOTE",
    "FP16_MAX", "FP16_MIN_NORMAL", "FP16_MIN_SUBNORMAL", "trains", "training_lowp_casts",
    "AutocastWrappedForward", "AutogradFunctionNoCustomFwd", "BackwardInAutocast", "BceUnderAutocast",
    "ClipWithoutUnscale", "DeprecatedAmpApi", "EpsAgainstParameters", "EpsUnderflowFp16",
    "EvalLossOutsideAutocast", "Float32BufferForKernel", "Fp16UnsafeConstant", "Fp16WithoutGradScaler",
    "GradScalerWithBf16", "GradsChangedBeforeUnscale", "OptimizerStepAroundScaler", "LinearAttentionSum", "LossOutsideAutocast",
    "ManualCast", "Float16ChosenOnBf16Path", "Float16OverBf16Option", "MaskConstantAgainstTraining", "PartialDtypeCasts", "ScalerSaveNeverRuns", "NormStatsInInputPrecision", "ReductionOutsideAutocast",
    "ScalerStateNotCheckpointed", "SoftmaxNoDtype", "UnscaleEveryMicroStep", "UnusedUpcastSoftmax",
    "Float32BesideActivations", "BatchIntoLowpModel", "StaleCopyWrittenBack", "CacheKeyedWithoutDtype", "PartialManualUnscale", "DtypeMatchUndone", "UpcastSkippedHere", "LayersOnUpcastInputElsewhere",
    "AverageInParameterDtype", "AverageCopyCastToLowp", "RotaryAnglesInLowPrecision", "GradScalerNotSharded", "AutocastOffWithoutUpcast", "GradNormInLowPrecision", "GradScalerWithoutAutocast", "LogUnderflowFp16", "LogProbsOnLowPrecisionLogits", "SensitiveOpUnderAutocast", "SENSITIVE_OPS",
]
