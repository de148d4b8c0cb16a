"""Every AMP rule the checker runs, in one table.

The original rules (``amp_rules``) judge a pattern where mixed-precision training is seen. Other
families extend them without growing that module: ``amp_loose`` reports the seed's patterns where
no training is seen (at LOW confidence, saying why); ``amp_bug_rules`` covers bug kinds that
public projects fixed (values judged against the precision a model trains in, checkpoints without
the loss scale, long reductions of attention products); ``amp_sensitive`` names computations
known to break in autocast's precision (a table of ops, each with its reason); ``amp_dtype_mix``
finds float32 tensors left beside the activations of a model that runs in half precision;
``amp_manual_scaling`` judges hand-written loss scaling. An extension that belongs to an existing
rule runs after that rule's own visitor under the same id; the first hit at a position wins.
"""
from __future__ import annotations

from dataclasses import replace

from training_profiler import amp_bug_rules as bugs
from training_profiler import amp_dtype_mix as dtype_mix
from training_profiler import amp_loose as loose
from training_profiler import amp_manual_scaling as manual_scaling
from training_profiler import amp_sensitive as sensitive
from training_profiler.amp_rules import RULES as BASE_RULES
from training_profiler.amp_rules import Rule, RuleVisitor

# rule id -> visitors run after the rule's own one
EXTENSIONS: dict[str, tuple[type[RuleVisitor], ...]] = {
    "AMP001": (loose.LooseManualCast,),
    "AMP002": (loose.LooseBce,),
    "AMP003": (bugs.EvalLossOutsideAutocast,),
    "AMP004": (bugs.UnusedUpcastSoftmax, loose.LooseSoftmax),
    "AMP005": (loose.LooseReduction,),
    "AMP006": (loose.LooseAutogradFunction,),
    "AMP010": (bugs.GradsChangedBeforeUnscale,),
    "AMP011": (bugs.MaskConstantAgainstTraining,),
    "AMP012": (bugs.EpsAgainstParameters,),
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
    for r in BASE_RULES) + bugs.NEW_RULES + sensitive.SENSITIVE_RULES + dtype_mix.DTYPE_MIX_RULES \
    + manual_scaling.MANUAL_SCALING_RULES
RULES_BY_ID = {r.id: r for r in RULES}
RULES_BY_NAME = {r.name: r for r in RULES}
