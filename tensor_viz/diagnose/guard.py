"""The auto-guard's decisions as findings (kind ``guard_decision``): what it moved, when, why.

Why a finding: a guarded run that trained well still had a format failing some GEMMs; the
diagnosis should say which, from which iteration, and what the run computed instead, so the plan
the guard handed back (guard/plan.yaml) is read with its evidence. One finding per iteration and
move (format -> format and the condition that held), its modules listed; LOW when the guard moved
GEMMs to a scaled variant of the same format, MEDIUM when to high precision (compute the run
meant to save). Read by tensor_capture.guard.read_decisions, the one reader of the file.
"""
from __future__ import annotations

import os
from typing import Any

from tensor_capture.guard import DECISIONS, GUARD_DIR, read_decisions
from tensor_viz.diagnose.rules import LOW, MEDIUM, RunFinding

KIND = "guard_decision"
CHECKED = f"the auto-guard's decisions ({GUARD_DIR}/{DECISIONS}, TENSOR_SAVE_GUARD)"


def guard_findings(capture_dir: str | os.PathLike[str]) -> list[RunFinding] | None:
    """The decisions of the run's guard grouped per (iteration, from, to, rule); None when the
    folder has no guard output (the kind is then not listed as checked)."""
    if not (os.path.isdir(os.path.join(capture_dir, GUARD_DIR))):
        return None
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for d in read_decisions(capture_dir):
        key = (int(d["iteration"]), d.get("from"), d["to"], d.get("rule"))
        groups.setdefault(key, []).append(d)
    out = []
    for (it, old, new, rule), decided in sorted(groups.items(), key=lambda kv: kv[0][0]):
        gemms = [f"{d['module']} {d['gemm']}" for d in decided]
        upcast = new == "hp"
        out.append(RunFinding(
            KIND, MEDIUM if upcast else LOW,
            f"The auto-guard moved {len(gemms)} GEMM(s) from {old} to {new} after iteration "
            f"{it} ({rule} held on {', '.join(sorted({d['operand'] for d in decided}))}): "
            f"{_short(gemms)}.",
            {"iteration": it, "module_path": decided[0]["module"]},
            {"gemms": gemms, "from": old, "to": new, "rule": rule,
             "evidence": [d.get("evidence") for d in decided]},
            f"{GUARD_DIR}/{DECISIONS}",
            f"Reuse {GUARD_DIR}/plan.yaml as CUSTOM_QUANT_PLAN from step 0"
            + ("; it computes these GEMMs in high precision" if upcast else "") + ".",
            onset=it))
    return out


def _short(gemms: list[str], limit: int = 4) -> str:
    more = len(gemms) - limit
    return ", ".join(gemms[:limit]) + (f" and {more} more" if more > 0 else "")
