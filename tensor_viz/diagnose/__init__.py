"""From a capture to the cause: the findings of ``lowp-diagnose``, the report's "Diagnosis"
section and the one-click output.

:func:`diagnose` brings the capture's columnar index up to date, runs every kind of
:data:`KINDS` (each a query over the index, :mod:`tensor_viz.diagnose.rules`) and ranks the
findings, the cause first: severity, then the iteration where the problem starts, then the kind's
place in :data:`KINDS` (a non-finite origin before the drift that may explain it only when they
start in the same iteration), then the execution position. A run with no finding says so and
lists what was checked. docs/diagnose.md documents the JSON.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowp_common import UserError
from tensor_capture import schema
from tensor_capture.guard import GUARD_DIR
from tensor_capture.recorder import read as recorder_read
from tensor_capture.stats_read import merged_std_sql
from tensor_viz import columnar
from tensor_viz.diagnose import formats as diagnose_format
from tensor_viz.diagnose import loss as loss_kinds
from tensor_viz.diagnose import recorder_view, rules
from tensor_viz.diagnose.guard import CHECKED as GUARD_CHECKED
from tensor_viz.diagnose.guard import KIND as GUARD_KIND
from tensor_viz.diagnose.guard import guard_findings
from tensor_viz.diagnose.loss import read_losses
from tensor_viz.diagnose.rules import HIGH, LOW, MEDIUM, SEVERITY_ORDER, Finding


def _format_loss(con: Any, inp: rules.Inputs) -> list[Finding]:
    if inp.nested is None or not con.execute(
            f"SELECT count(*) FROM {inp.narrow} WHERE has_whatif").fetchone()[0]:
        return []                 # nothing to judge: no torch import, no baseline
    from quant.format_loss import baseline_sqnr, loss_severity

    fmts = {r[0] for r in con.execute(
        f"SELECT DISTINCT coalesce(emulated_format, quant_type) FROM {inp.narrow}").fetchall()
        if r[0]}
    return rules.format_loss(con, inp, fmts, baseline_sqnr, loss_severity)


Query = Callable[[Any, rules.Inputs], list[Finding]]


@dataclass(frozen=True)
class Kind:
    """One diagnosis kind, registered once: what "checked" says it looked at, and its query on
    each engine, ``query(con, inputs)`` (tensor_viz.diagnose.rules.Inputs: the narrow table,
    the nested dataset where there is one): ``duckdb`` over the columnar index (lowp-diagnose,
    the report), ``spark`` in Spark SQL (``--engine spark``, tensor_viz.diagnose.spark; None:
    DuckDB only). ``lacks``: what a flight recorder's summaries lack for it ("" when it runs on
    them), said under ``checked`` for a folder of summaries alone."""

    checked: str
    duckdb: Query
    spark: Query | None = None
    lacks: str = ""


def _same_sql(query: Query, checked: str, lacks: str = "") -> Kind:
    """A kind whose SQL is the same text on both engines (tensor_viz.diagnose.sql_dialect spells the
    few expressions that differ)."""
    return Kind(checked, query, spark=query, lacks=lacks)


def _narrow(query: Callable[[Any, str], list[Finding]], checked: str, lacks: str = "") -> Kind:
    """A kind whose query reads only the narrow table (``query(con, narrow)``)."""
    def on_narrow(con: Any, inp: rules.Inputs) -> list[Finding]:
        return query(con, inp.narrow)

    return _same_sql(on_narrow, checked, lacks)


#: kind -> its Kind (what it checked, each engine's query); the order breaks ranking ties
KINDS: dict[str, Kind] = {
    "first_nonfinite": _narrow(rules.first_nonfinite,
                               "NaN/Inf counts of every record, in execution order across ranks"),
    diagnose_format.KIND: _same_sql(
        diagnose_format.run_format_loss,
        "energy (gradients: also elements) flushed to zero and elements saturated of every GEMM "
        "operand in the run's own format (stats.range[quant_type] and log2_hist, quant.analysis' "
        "definitions; a recorder's summaries: their flush and saturation counts)"),
    "range_drift": _narrow(rules.range_drift,
                           "absmax of each tensor over iterations against its format's largest "
                           "value"),
    "format_loss": _same_sql(_format_loss, "what-if SQNR of each tensor and format against the "
                             "format's Gaussian baseline (quant.format_loss)",
                             lacks="needs what-if numerics, which recorder summaries do not "
                                   "keep"),
    "attention_logit_growth": _narrow(rules.attention_logit_growth,
                                      "max |q.k|/sqrt(d) per layer over iterations (bound from "
                                      "the query / key absmax)",
                                      lacks="needs the query's head dimension (its shape), "
                                            "which recorder summaries do not keep"),
    "rank_outlier": _same_sql(rules.rank_outlier,
                              "each rank against the median of the ranks "
                              "(tensor_viz.rank_tables: absmax, std, flush, underflow, "
                              "overflow, non-finite counts)"),
}
#: the engines ``--engine`` names, the first the default
ENGINES = ("duckdb", "spark")
_KIND_ORDER = {k: i for i, k in enumerate([*KINDS, "loss_spike", "loss_divergence",
                                            "reference_gap", GUARD_KIND])}


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)
    checked: dict[str, str] = field(default_factory=dict)
    records: int = 0
    capture: str = ""
    summary_rows: int = 0       # flight recorder summary rows read beside the records

    def to_json(self) -> dict[str, Any]:
        return {"findings": [f.to_dict() for f in self.findings], "checked": self.checked,
                "records": self.records, "summary_rows": self.summary_rows}

    def lines(self, limit: int = 20) -> list[str]:
        """The findings as text, the cause first (what the command and one-click print)."""
        read = f"{self.records:,} records" + (
            f" and {self.summary_rows:,} recorder summary rows" if self.summary_rows else "")
        if not self.findings:
            out = [f"diagnosis of {self.capture}: healthy: no finding in {read}."]
        else:
            out = [f"diagnosis of {self.capture}: {len(self.findings)} finding(s) in "
                   f"{read}, the cause first:"]
            for n, f in enumerate(self.findings[:limit], 1):
                out.append(f"{n:>3}. [{f.severity}] {f.kind}: {f.summary}")
                out.append(f"     try: {f.action}")
            if len(self.findings) > limit:
                out.append(f"     ... {len(self.findings) - limit} more (--json lists all)")
        out.append("checked: " + "; ".join(f"{k} ({v})" for k, v in self.checked.items()))
        return out


def rank(findings: list[Finding]) -> list[Finding]:
    """The cause first: severity (calibrated against measured harm), then the iteration it
    starts (one present from the first iteration outranks a consequence that starts later),
    then the kind and the execution position."""
    return sorted(findings, key=lambda f: (
        SEVERITY_ORDER[f.severity], f.onset if f.onset is not None else math.inf,
        _KIND_ORDER.get(f.kind, 99), f.position))


def first_cause(candidates: list[Finding]) -> Finding | None:
    """The top-ranked of ``candidates`` (what a loss finding follows), None when empty."""
    return rank(candidates)[0] if candidates else None


def relate(findings: list[Finding]) -> None:
    """A range_drift whose tensors a run_format_loss finding also names says so: the flush /
    saturation is the cause (or the same fact seen as a level), the drift its effect there; one
    that starts later than the drift is the drift's consequence ("leads_to").
    When the tensor that grades the drift is one of them, the drift yields to it: severity
    capped at MEDIUM, starting no earlier than the cause."""
    causes = rank([f for f in findings if f.kind == diagnose_format.KIND])
    for drift in (f for f in findings if f.kind == "range_drift"):
        mine = {rules._label(drift.where)} | {m["tensor"] for m in
                                               drift.evidence.get("moves_with_it", [])}
        for cause in causes:
            covered = {rules._label(cause.where)} | {m["tensor"] for m in
                                                      cause.evidence.get("operands", [])}
            if not mine & covered:
                continue
            if cause.onset is not None and drift.onset is not None and cause.onset > drift.onset:
                drift.evidence.setdefault("leads_to", cause.to_dict())
                drift.summary = (drift.summary.rstrip(".") + f"; it leads to {cause.kind} of "
                                 f"{', '.join(sorted(mine & covered)[:3])} from iteration "
                                 f"{cause.onset}.")
                continue
            drift.evidence["follows"] = cause.to_dict()
            drift.summary = (drift.summary.rstrip(".") + f"; {cause.kind} names "
                             f"{', '.join(sorted(mine & covered)[:3])} from iteration "
                             f"{cause.onset}: this drift is its effect there.")
            if drift.evidence.get("severity_from") in covered:     # graded by the same fact
                if SEVERITY_ORDER[drift.severity] < SEVERITY_ORDER[MEDIUM]:
                    drift.severity = MEDIUM
                if cause.onset is not None:
                    drift.onset = max(drift.onset if drift.onset is not None else 0,
                                      cause.onset)
            break


def open_index(capture_dir: str | os.PathLike[str], cache_dir: Any = None,
               skip_bad_lines: bool = False, what: str = "CAPTURE_DIR",
               say: Callable[[str], None] | None = None
               ) -> tuple[Any, columnar.IndexState | None]:
    """The index of a capture folder, refusing a folder without manifests and (unless
    ``skip_bad_lines``) a manifest with a line that is not a record. A flight recorder's folder
    with summaries and no record yet gives (a connection, None): diagnosis reads the summaries."""
    root = Path(capture_dir)
    if not root.is_dir():
        raise UserError(f"{what} {root}: no such folder")
    if not any(root.glob(schema.MANIFEST_GLOB)) and (
            recorder_view.has_summaries(root) or (root / GUARD_DIR).is_dir()):
        return columnar.connect(), None          # a flight recorder that never triggered
    if not any(root.glob(schema.MANIFEST_GLOB)):
        raise UserError(f"{what} {root}: no {schema.MANIFEST_GLOB} in it; point at the folder "
                        "the capture wrote (TENSOR_SAVE_DIR)")
    con = columnar.connect()
    state = columnar.refresh(root, cache_dir, say=say, con=con)
    if state.bad_lines and not skip_bad_lines:
        example = state.bad_examples[0] if state.bad_examples else "a line"
        raise UserError(f"{what} {root}: {state.bad_lines} torn or foreign manifest line(s), "
                        f"first {example}; --skip-bad-lines diagnoses the records around them")
    if state.records == 0:
        raise UserError(f"{what} {root}: the manifests hold no capture record")
    return con, state


def _modules(con, src: str) -> set[str]:
    return {r[0] for r in con.execute(
        f"SELECT DISTINCT module_path FROM {src}").fetchall() if r[0]}


def reference_gap(con, src: str, ref_con, ref_src: str, what: str) -> list[Finding]:
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
    return [Finding("reference_gap", MEDIUM,
                    f"First departure from the reference: {rules._label(where)} at iteration "
                    f"{it}, std {row[-1]:.4g} vs {other:.4g} ({100 * gap:.0f}% apart).",
                    where, {"std": row[-1], "reference_std": other, "relative_gap": gap,
                            "departing_cells": len(gaps)},
                    "index.html: numerics_map", "Keep this module in the reference precision "
                    "and compare again (precision-diff narrows it to one GEMM).",
                    onset=it, position=p)]


REF_GAP = 0.25


def _losses(capture_dir: str | os.PathLike[str],
            loss: Any) -> tuple[list[tuple[int, float]] | None, str]:
    """(the losses the loss kinds judge, where they came from): the ``--loss`` log or
    TensorBoard folder when given, else the losses a flight recorder wrote in ``capture_dir``
    (None when there are none: the loss kinds are then not checked)."""
    if loss is not None:
        return read_losses(loss), loss_kinds.LOG_SOURCE
    return recorder_read.read_losses(capture_dir) or None, loss_kinds.RECORDER_SOURCE


def _duckdb_inputs(con: Any, state: columnar.IndexState | None, capture_dir: Any,
                   rank_view: Any) -> rules.Inputs:
    """The narrow table on DuckDB: the records' (when there are any), with a flight recorder's
    summary rows where no record covers the iteration."""
    if state is None:                  # summaries only: the narrow table is theirs
        rows = recorder_view.narrow_from_summaries(con, rules.NARROW, capture_dir)
        return rules.Inputs(rules.NARROW, None, 0, rows, rank_view)
    src = rules.materialize(con, state)
    rows = recorder_view.add_summaries(con, src, capture_dir)
    return rules.Inputs(src, rules.source(state), state.records, rows, rank_view)


def diagnose(capture_dir: str | os.PathLike[str], reference: Any = None, loss: Any = None,
             cache_dir: Any = None, skip_bad_lines: bool = False,
             say: Callable[[str], None] | None = None, con: Any = None,
             state: columnar.IndexState | None = None, rank_view: Any = None,
             engine: str = "duckdb", spark_master: str | None = None) -> Diagnosis:
    """Every finding of a capture or flight recorder folder, ranked (module docstring).
    ``engine``: "duckdb" (one machine) or "spark" (``spark_master``, default local mode:
    tensor_viz.diagnose.spark); the same kinds, the same ranking after the queries.
    ``con``/``state``: a DuckDB index the caller already opened, ``rank_view``: its
    rank_tables.RankView (the report)."""
    if engine not in ENGINES:
        raise UserError(f"--engine {engine}: not one of {', '.join(ENGINES)}")
    if engine == "spark":
        from tensor_viz.diagnose import spark as diagnose_spark

        def index() -> columnar.IndexState | None:
            return open_index(capture_dir, cache_dir, skip_bad_lines, say=say)[1]

        with diagnose_spark.opened(capture_dir, spark_master, index) as (spark_con, inp):
            return _diagnose(capture_dir, spark_con, inp, "spark", reference, loss,
                             skip_bad_lines, say)
    if con is None or state is None:
        con, state = open_index(capture_dir, cache_dir, skip_bad_lines, say=say)
    inp = _duckdb_inputs(con, state, capture_dir, rank_view)
    return _diagnose(capture_dir, con, inp, "duckdb", reference, loss, skip_bad_lines, say)


def _run_kinds(con: Any, inp: rules.Inputs, engine: str, checked: dict[str, str]
               ) -> list[Finding]:
    found: list[Finding] = []
    for name, kind in KINDS.items():
        if inp.nested is None and not inp.summary_rows:   # e.g. a guard on a rank with no site
            checked[name] = "not checked: the folder holds no record and no summary row"
            continue
        if inp.nested is None and kind.lacks:
            checked[name] = f"not checked: {kind.lacks}"
            continue
        query = kind.duckdb if engine == "duckdb" else kind.spark
        if query is None:
            checked[name] = f"not checked: no {engine} query"
            continue
        found += query(con, inp)
        checked[name] = kind.checked
    return found


def _diagnose(capture_dir: Any, con: Any, inp: rules.Inputs, engine: str, reference: Any,
              loss: Any, skip_bad_lines: bool, say: Callable[[str], None] | None) -> Diagnosis:
    """The one path after the engine opened the folder: the kinds, the reference, the losses,
    the guard, then relate() and rank()."""
    losses, source = _losses(capture_dir, loss)
    ref = None
    if reference is not None:
        ref = open_index(reference, None, skip_bad_lines, what="--reference", say=say)
        if ref[1] is None:
            raise UserError(f"--reference {reference}: holds flight recorder summaries and no "
                            "record; give a capture with records (a triggered recorder folder "
                            "or a capture)")
    result = Diagnosis(records=inp.records, capture=str(capture_dir),
                       summary_rows=inp.summary_rows)
    src = inp.narrow
    found = _run_kinds(con, inp, engine, result.checked)
    if result.summary_rows:
        triggers = recorder_view.triggers_text(capture_dir)
        result.checked["recorder"] = (
            f"{result.summary_rows:,} summary rows of the flight recorder (iteration x site, "
            "micro-batches merged) where no record covers the iteration; triggers: "
            f"{triggers or 'none'}")
    if ref is not None:
        found += reference_gap(con, src, ref[0], rules.materialize(*ref), str(reference))
        result.checked["reference_gap"] = f"std of each tensor against {reference}"
    if losses is not None:
        found += (loss_kinds.spikes(losses, found, first_cause, source)
                  + loss_kinds.divergence(losses, found, loss_kinds.vocab_size(con, src)
                                          if inp.records or inp.summary_rows else None,
                                          first_cause, source))
        result.checked["loss_spike"] = (f"{len(losses)} loss values ({source}), spike above "
                                        f"mean + {loss_kinds.LOSS_SIGMAS:g} std of the last "
                                        f"{loss_kinds.LOSS_WINDOW}")
        result.checked["loss_divergence"] = (f"the loss by level ({source}): above "
                                             f"{loss_kinds.DIVERGE_FACTOR:g} x its "
                                             f"early minimum or ln(vocabulary) and staying "
                                             f"there, or a plateau against its early minimum")
    guarded = guard_findings(capture_dir)
    if guarded is not None:
        found += guarded
        result.checked[GUARD_KIND] = GUARD_CHECKED
    relate(found)
    result.findings = rank(found)
    return result


__all__ = [
    "HIGH",
    "KINDS",
    "Kind",
    "LOW",
    "MEDIUM",
    "ENGINES",
    "Diagnosis",
    "Finding",
    "diagnose",
    "open_index",
    "rank",
    "read_losses",
]
