"""The kind ``reference_gap``: the first tensor whose spread departs from a reference capture of
the same model (``lowp-diagnose --reference``).

Why its own module: it reads a second index (the reference's, opened by the caller) beside the
run's own narrow table; the other kinds read one folder.
"""
from __future__ import annotations

import math

from lowp_common import UserError
from tensor_capture.stats_read import merged_std_sql
from tensor_viz import columnar
from tensor_viz.diagnose import rules
from tensor_viz.diagnose.rules import MEDIUM, RunFinding

KIND = "reference_gap"
#: a std further apart than this share of the reference's is a departure
REF_GAP = 0.25


def _modules(con, src: str) -> set[str]:
    return {r[0] for r in con.execute(
        f"SELECT DISTINCT module_path FROM {src}").fetchall() if r[0]}


def reference_gap(con, src: str, ref_con, ref_src: str, what: str) -> list[RunFinding]:
    """The first tensor (execution order) whose std (over ranks and micro-batches, merged from
    counts, sums and sums of squares) differs from the reference capture's by more than REF_GAP; refuses a reference of another model (other module paths)."""
    mine, theirs = _modules(con, src), _modules(ref_con, ref_src)
    if mine and theirs and mine != theirs:
        only = sorted(mine ^ theirs)[:2]
        raise UserError(f"--reference {what}: a capture of another model ({len(mine ^ theirs)} "
                        f"module path(s) differ, e.g. {', '.join(only)}); give a capture of the "
                        "same model")
    key = ", ".join(rules.TENSOR_KEY)
    q = (f"SELECT {key}, iteration, {merged_std_sql()} AS std FROM {{src}} WHERE "
         f"variant = {columnar.SQL_HP} AND {rules.FINITE_MOMENTS} GROUP BY {key}, iteration")
    ref = {tuple(r[:-1]): r[-1] for r in ref_con.execute(q.format(src=ref_src)).fetchall()}
    pos = rules.positions(con, src)
    gaps = []
    for row in con.execute(q.format(src=src)).fetchall():
        other = ref.get(tuple(row[:-1]))
        if other is None or row[-1] is None or not other:
            continue
        gap = abs(row[-1] - other) / abs(other)
        if gap > REF_GAP or math.isnan(gap):
            gaps.append((row[-2], pos.get(tuple(row[:-2]), math.inf), row, other, gap))
    if not gaps:
        return []
    it, p, row, other, gap = min(gaps, key=lambda g: (g[0], g[1]))
    where = dict(zip(rules.TENSOR_KEY, row[:-2]), iteration=it)
    return [RunFinding(KIND, MEDIUM,
                    f"First departure from the reference: {rules._label(where)} at iteration "
                    f"{it}, std {row[-1]:.4g} vs {other:.4g} ({100 * gap:.0f}% apart).",
                    where, {"std": row[-1], "reference_std": other, "relative_gap": gap,
                            "departing_cells": len(gaps)},
                    "index.html: numerics_map", "Keep this module in the reference precision "
                    "and compare again (precision-diff narrows it to one GEMM).",
                    onset=it, position=p)]

