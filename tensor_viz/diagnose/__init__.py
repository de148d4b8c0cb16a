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
from tensor_viz import columnar
from tensor_viz.diagnose import formats as diagnose_format
from tensor_viz.diagnose import guard as guard_kind
from tensor_viz.diagnose import loss as loss_kinds
from tensor_viz.diagnose import recorder_view, reference, rules
from tensor_viz.diagnose.loss import read_losses
from tensor_viz.diagnose.rules import HIGH, LOW, MEDIUM, SEVERITY_ORDER, RunFinding


def _format_loss(con: Any, inp: rules.Inputs) -> list[RunFinding]:
    if inp.nested is None or not con.execute(
            f"SELECT count(*) FROM {inp.narrow} WHERE has_whatif").fetchone()[0]:
        return []                 # nothing to judge: no torch import, no baseline
    from quant.format_loss import baseline_sqnr, loss_severity

    fmts = {r[0] for r in con.execute(
        f"SELECT DISTINCT coalesce(emulated_format, quant_type) FROM {inp.narrow}").fetchall()
        if r[0]}
    return rules.format_loss(con, inp, fmts, baseline_sqnr, loss_severity)


Query = Callable[[Any, rules.Inputs], list[RunFinding]]


@dataclass(frozen=True)
class Kind:
    """One diagnosis kind, registered once: what "checked" says it looked at (a text, or made
    from the inputs), and its query on each engine, ``query(con, inputs)``
    (tensor_viz.diagnose.rules.Inputs): ``duckdb`` over the columnar index (lowp-diagnose, the
    report), ``spark`` in Spark SQL (``--engine spark``, tensor_viz.diagnose.spark; None: DuckDB
    only). ``lacks``: what a flight recorder's summaries lack for it ("" when it runs on them),
    said under ``checked`` for a folder of summaries alone. ``reads``: the inputs it needs
    (keys of :data:`READS`); it runs when the inputs hold them all."""

    checked: str | Callable[[rules.Inputs], str]
    duckdb: Query
    spark: Query | None = None
    lacks: str = ""
    reads: tuple[str, ...] = ("records",)


@dataclass(frozen=True)
class Read:
    """One input a kind may read: whether the inputs hold it, and what "checked" says of a kind
    that needs it when they do not ("": nothing, the kind is left out, as an option not given)."""

    held: Callable[[rules.Inputs], bool]
    absent: str = ""


#: what a kind can read -> when it is there. ``findings``: the findings about tensors, those of
#: the kinds that read the records or a reference (TENSOR_READS); a kind reading them runs after
#: every kind that does not
READS = {
    "records": Read(lambda i: i.nested is not None or i.summary_rows > 0,
                    "not checked: the folder holds no record and no summary row"),
    "summaries": Read(lambda i: i.summary_rows > 0),
    "losses": Read(lambda i: i.losses is not None),
    "reference": Read(lambda i: i.reference is not None),
    "guard": Read(lambda i: i.guard is not None),
    "findings": Read(lambda i: i.findings is not None),
}
TENSOR_READS = ("records", "reference")


def _same_sql(query: Query, checked: str | Callable[[rules.Inputs], str], lacks: str = "",
              reads: tuple[str, ...] = ("records",)) -> Kind:
    """A kind whose SQL (or Python) is the same on both engines (tensor_viz.diagnose.sql_dialect
    spells the few expressions that differ)."""
    return Kind(checked, query, spark=query, lacks=lacks, reads=reads)


def _narrow(query: Callable[[Any, str], list[RunFinding]], checked: str, lacks: str = "") -> Kind:
    """A kind whose query reads only the narrow table (``query(con, narrow)``)."""
    def on_narrow(con: Any, inp: rules.Inputs) -> list[RunFinding]:
        return query(con, inp.narrow)

    return _same_sql(on_narrow, checked, lacks)


def _recorder(con: Any, inp: rules.Inputs) -> list[RunFinding]:
    return []                     # no finding of its own: "checked" says what was read


def _recorder_checked(inp: rules.Inputs) -> str:
    triggers = recorder_view.triggers_text(inp.folder)
    return (f"{inp.summary_rows:,} summary rows of the flight recorder (iteration x site, "
            f"micro-batches merged) where no record covers the iteration; triggers: "
            f"{triggers or 'none'}")


def _spikes(con: Any, inp: rules.Inputs) -> list[RunFinding]:
    return loss_kinds.spikes(inp.losses, inp.findings, first_cause, inp.loss_source)


def _divergence(con: Any, inp: rules.Inputs) -> list[RunFinding]:
    vocab = (loss_kinds.vocab_size(con, inp.narrow) if inp.records or inp.summary_rows
             else None)
    return loss_kinds.divergence(inp.losses, inp.findings, vocab, first_cause, inp.loss_source)


def _reference_gap(con: Any, inp: rules.Inputs) -> list[RunFinding]:
    ref_con, ref_state, what = inp.reference
    return reference.reference_gap(con, inp.narrow, ref_con,
                                   rules.materialize(ref_con, ref_state), what)


def _guard(con: Any, inp: rules.Inputs) -> list[RunFinding]:
    return guard_kind.guard_findings(inp.folder) or []


#: kind -> its Kind (what it checked, each engine's query, what it reads); the order breaks
#: ranking ties and is the order of "checked"
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
    "recorder": _same_sql(_recorder, _recorder_checked, reads=("summaries",)),
    "loss_spike": _same_sql(
        _spikes, lambda i: (f"{len(i.losses)} loss values ({i.loss_source}), spike above mean "
                            f"+ {loss_kinds.LOSS_SIGMAS:g} std of the last "
                            f"{loss_kinds.LOSS_WINDOW}"), reads=("losses", "findings")),
    "loss_divergence": _same_sql(
        _divergence, lambda i: (f"the loss by level ({i.loss_source}): above "
                                f"{loss_kinds.DIVERGE_FACTOR:g} x its early minimum or "
                                "ln(vocabulary) and staying there, or a plateau against its "
                                "early minimum"), reads=("losses", "findings")),
    reference.KIND: _same_sql(_reference_gap, lambda i: f"std of each tensor against {i.reference[2]}",
                              reads=("reference",)),
    guard_kind.KIND: _same_sql(_guard, guard_kind.CHECKED, reads=("guard",)),
}
#: the engines ``--engine`` names, the first the default
ENGINES = ("duckdb", "spark")


@dataclass
class Diagnosis:
    findings: list[RunFinding] = field(default_factory=list)
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


def rank(findings: list[RunFinding]) -> list[RunFinding]:
    """The cause first: severity (calibrated against measured harm), then the iteration it
    starts (one present from the first iteration outranks a consequence that starts later),
    then the kind and the execution position."""
    order = {k: i for i, k in enumerate(KINDS)}
    return sorted(findings, key=lambda f: (
        SEVERITY_ORDER[f.severity], f.onset if f.onset is not None else math.inf,
        order.get(f.kind, len(order)), f.position))


def first_cause(candidates: list[RunFinding]) -> RunFinding | None:
    """The top-ranked of ``candidates`` (what a loss finding follows), None when empty."""
    return rank(candidates)[0] if candidates else None


def relate(findings: list[RunFinding]) -> None:
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


def _run(con: Any, inp: rules.Inputs, engine: str, names: list[str],
         checked: dict[str, str]) -> dict[str, list[RunFinding]]:
    """The findings of each kind of ``names`` whose inputs are there; what each checked (or
    why not) into ``checked``."""
    found: dict[str, list[RunFinding]] = {}
    for name in names:
        kind = KINDS[name]
        missing = next((r for r in kind.reads if not READS[r].held(inp)), None)
        if missing is not None:
            if READS[missing].absent:
                checked[name] = READS[missing].absent
            continue
        if inp.nested is None and kind.lacks:
            checked[name] = f"not checked: {kind.lacks}"
            continue
        query = kind.duckdb if engine == "duckdb" else kind.spark
        if query is None:
            checked[name] = f"not checked: no {engine} query"
            continue
        found[name] = query(con, inp)
        checked[name] = kind.checked(inp) if callable(kind.checked) else kind.checked
    return found


def _run_kinds(con: Any, inp: rules.Inputs, engine: str, checked: dict[str, str]
               ) -> list[RunFinding]:
    """Every kind of :data:`KINDS`: first those that do not read findings, then, with the
    findings about tensors, those that do; ``checked`` in the order of KINDS."""
    later = [k for k, kind in KINDS.items() if "findings" in kind.reads]
    said: dict[str, str] = {}
    found = _run(con, inp, engine, [k for k in KINDS if k not in later], said)
    inp.findings = [f for k, fs in found.items() if set(KINDS[k].reads) & set(TENSOR_READS)
                    for f in fs]
    found.update(_run(con, inp, engine, later, said))
    checked.update((k, said[k]) for k in KINDS if k in said)
    return [f for k in KINDS for f in found.get(k, ())]


def _reference(reference: Any, skip_bad_lines: bool, say: Callable[[str], None] | None
               ) -> tuple[Any, Any, str] | None:
    """(connection, index, name) of the ``--reference`` capture, None without one."""
    if reference is None:
        return None
    con, state = open_index(reference, None, skip_bad_lines, what="--reference", say=say)
    if state is None:
        raise UserError(f"--reference {reference}: holds flight recorder summaries and no "
                        "record; give a capture with records (a triggered recorder folder "
                        "or a capture)")
    return con, state, str(reference)


def _diagnose(capture_dir: Any, con: Any, inp: rules.Inputs, engine: str, reference: Any,
              loss: Any, skip_bad_lines: bool, say: Callable[[str], None] | None) -> Diagnosis:
    """The one path after the engine opened the folder: what the folder and the command line
    add to the inputs, every kind (:func:`_run_kinds`), then relate() and rank()."""
    inp.folder = capture_dir
    inp.losses, inp.loss_source = _losses(capture_dir, loss)
    inp.reference = _reference(reference, skip_bad_lines, say)
    inp.guard = (Path(capture_dir) / GUARD_DIR) if (Path(capture_dir) / GUARD_DIR).is_dir() \
        else None
    result = Diagnosis(records=inp.records, capture=str(capture_dir),
                       summary_rows=inp.summary_rows)
    found = _run_kinds(con, inp, engine, result.checked)
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
    "RunFinding",
    "diagnose",
    "open_index",
    "rank",
    "read_losses",
]
