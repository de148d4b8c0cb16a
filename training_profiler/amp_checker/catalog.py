"""Every AMP rule the checker runs, in one table.

The rules of ``training_profiler.amp_checker.rules`` (one module per family, each rule declared on its
visitor) judge a pattern where mixed-precision training is seen. Extension visitors reach further
under the same id: ``loose`` reports the documented patterns where no training is seen (at LOW
confidence, saying why), and visitors in the rule's own family module cover bug kinds public
projects fixed (values judged against the precision a model trains in, evaluation losses, unused
float32 copies). ``EXTENSIONS`` names them; each runs after the rule's own visitor, and the first
hit at a position wins. The bug-kind rules (``rules.BUG_KIND_RULES``: checkpoints without the
loss scale, long reductions of attention products) follow the documented ones.
"""
from __future__ import annotations

from dataclasses import replace

from training_profiler.amp_checker import loose as loose
from training_profiler.amp_checker.rules import (
    BUG_KIND_RULES,
    AverageCopyCastToLowp,
    BatchIntoLowpModel,
    CacheKeyedWithoutDtype,
    EpsAgainstParameters,
    EvalLossOutsideAutocast,
    Float16ChosenOnBf16Path,
    Float16OverBf16Option,
    GradsChangedBeforeUnscale,
    LayersOnUpcastInputElsewhere,
    MaskConstantAgainstTraining,
    OptimizerStepAroundScaler,
    PartialDtypeCasts,
    Rule,
    RuleVisitor,
    ScalerSaveNeverRuns,
    StaleCopyWrittenBack,
    UnusedUpcastSoftmax,
)
from training_profiler.amp_checker.rules import RULES as BASE_RULES

# rule id -> visitors run after the rule's own one
EXTENSIONS: dict[str, tuple[type[RuleVisitor], ...]] = {
    "AMP001": (Float16ChosenOnBf16Path, Float16OverBf16Option, loose.LooseManualCast),
    "AMP002": (loose.LooseBce,),
    "AMP003": (EvalLossOutsideAutocast,),
    "AMP004": (UnusedUpcastSoftmax, loose.LooseSoftmax),
    "AMP005": (loose.LooseReduction,),
    "AMP006": (PartialDtypeCasts, loose.LooseAutogradFunction),
    "AMP010": (GradsChangedBeforeUnscale, OptimizerStepAroundScaler),
    "AMP011": (MaskConstantAgainstTraining,),
    "AMP012": (EpsAgainstParameters,),
    "AMP018": (ScalerSaveNeverRuns,),
    "AMP021": (BatchIntoLowpModel, StaleCopyWrittenBack, CacheKeyedWithoutDtype),
    "AMP024": (LayersOnUpcastInputElsewhere,),
    "AMP025": (AverageCopyCastToLowp,),
}


def _chained(first: type[RuleVisitor], more: tuple[type[RuleVisitor], ...]) -> type[RuleVisitor]:
    """One visitor class that runs ``first`` and then each of ``more`` on the same module."""
    def run(self) -> list:
        hits = list(first(self.ctx).run())
        for visitor in more:
            hits += visitor(self.ctx).run()
        return hits
    return type(first.__name__ + "Extended", (RuleVisitor,), {"run": run, "__doc__": first.__doc__})


RULES: tuple[Rule, ...] = tuple(
    replace(r, visitor=_chained(r.visitor, EXTENSIONS[r.id])) if r.id in EXTENSIONS else r
    for r in BASE_RULES + BUG_KIND_RULES)
RULES_BY_ID = {r.id: r for r in RULES}
RULES_BY_NAME = {r.name: r for r in RULES}
