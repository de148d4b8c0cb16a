"""The kinds of finding ``lowp-diagnose`` looks for: each a query over the columnar index
(:mod:`tensor_viz.columnar`, DuckDB over Parquet) that returns aggregates, then a small rule in
Python over those aggregates. docs/diagnose.md states each rule; the numbers are here, once.

Every query reads the dataset through :func:`source` and returns at most one row per
(tensor x iteration) or per (tensor x format), never per record, so the memory does not grow
with the capture. The same SQL runs in Spark (``tests/test_diagnose_spark.py``) over the same
Parquet files.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quant.severity import HIGH_THRESHOLD
from quant.vocabulary import FINDING_LEVELS, Severity
from tensor_capture import schema
from tensor_viz import rank_tables
from tensor_viz.columnar import SQL_HP, IndexState, sql_string
from tensor_viz.diagnose.sql_dialect import dialect, named_struct

#: a finding's severity as it prints (quant.vocabulary.Severity's labels) and its rank, worst
#: first (0 = HIGH): the sort key of the ranking
HIGH, MEDIUM, LOW = (s.label for s in (Severity.HIGH, Severity.MEDIUM, Severity.LOW))
SEVERITY_ORDER = {s.label: Severity.HIGH - s for s in FINDING_LEVELS}

#: the capture's own keys a finding copies from the record it points at (tensor_capture.schema)
LOCATION_KEYS = ("iteration", "sample_idx", "rank", "layer_idx", schema.META_MODULE_PATH,
                 "operation", "tensor_name", "phase")
#: the columns that name one tensor over iterations
TENSOR_KEY = (schema.META_MODULE_PATH, "layer_idx", "operation", "phase", "tensor_name")

# -- trend rules (range_drift, attention_logit_growth, run_format_loss) -----------------------------
#: a trend needs this many iterations, this goodness of fit and this total rise
MIN_TREND_POINTS = 4
MIN_R2 = 0.8
MIN_RISE_BINADES = 1.0          # absmax: at least doubled over the iterations seen
MIN_RATIO_RISE = 0.001          # flush / overflow ratio: +0.1 % of the elements ...
MIN_RATIO_FACTOR = 2.0          # ... and at least twice its first value
#: projected crossing within this many times the observed span is HIGH, within 10x MEDIUM
HIGH_SPAN, MEDIUM_SPAN = 1.0, 10.0
#: the ratio a flush / overflow trend is projected to reach (quant.analysis' "high")
RATIO_LIMIT = HIGH_THRESHOLD
#: captured (operation, tensor_name) of the GEMM operands the run's format casts -> the
#: operand's name in quant.gemm_plan.PLAN (outputs such as grad_weight are not cast: their
#: flush / overflow ratios describe nothing lost)
OPERANDS = {("forward", "input"): "input", ("forward", "weight"): "weight",
            ("backward", "grad_output"): "grad_output", ("backward", "weight"): "weight",
            ("forward", "query"): "query", ("forward", "key"): "key",
            ("forward", "value"): "value", ("forward", "attention_probs"): "probs"}
#: format_loss: a gradient is HIGH only when its signal falls below sqrt(3) x the format's
#: quantization noise (SQNR below 10 log10 3 = 4.77 dB), where FP4 training stops improving
#: ("FP4 all the way", arXiv 2505.19115); above it a deficit is MEDIUM: hifp8's gradients at
#: 14 dB (17.5 dB under its Gaussian baseline) train within seed noise of bf16 on the tiny Llama
GRADIENT_NOISE_DB = 10 * math.log10(3)
#: format_loss: a tensor with at least this fraction below the format's smallest normal loses
#: to the range (a scale is the remedy), not to the precision (a finer format)
UNDERFLOW_CAUSE = 0.5
#: attention: max |q.k|/sqrt(d) bound above which softmax is a one-hot (e^30 ~ 1e13)
LOGIT_HIGH = 30.0


@dataclass
class RunFinding:
    """One finding about a captured run (the checker's findings about source code are
    training_profiler.findings_report.Finding): where (the capture's keys), what, the numbers,
    where to look, what to try."""

    kind: str
    severity: str
    summary: str
    where: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    figure: str = ""
    action: str = ""
    onset: int | None = None      # iteration the problem starts (ranking)
    position: float = math.inf       # execution position in its iteration (ranking)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "severity": self.severity}
        out.update({k: self.where.get(k) for k in LOCATION_KEYS})
        out.update(summary=self.summary, evidence=self.evidence, figure=self.figure,
                   action=self.action)
        return out


def source(state: IndexState) -> str:
    """The Parquet dataset of the index, as a relation."""
    return (f"read_parquet({sql_string(state.parquet_glob)}, hive_partitioning=true, "
            "union_by_name=true)")


#: the narrow table the kinds read (format_loss and run_format_loss also read the nested dataset
#: where there is one): one scan of the dataset keeps the columns they need (statistics
#: flattened, the run format's range picked), so each query reads a few flat columns instead of
#: decoding the nested Parquet again; a flight recorder's summaries fill the same columns
#: (tensor_viz.diagnose.recorder_view)
NARROW = "diag_records"


def materialize(con: Any, state: IndexState | None, relation: str | None = None) -> str:
    """Create (or replace) :data:`NARROW` on ``con`` from the index (or from ``relation``, a
    table holding the Parquet dataset's columns, e.g. a Spark view); returns its name."""
    d = dialect(con)
    con.execute(f"""CREATE OR REPLACE TEMP TABLE {NARROW} AS SELECT
        rank, iteration, sample_idx, counter, layer_idx, module_path, operation, phase,
        tensor_name, quant_type, emulated_format, coalesce(variant, {SQL_HP}) AS variant,
        {d['last_dim']} AS last_dim,
        stats.absmax AS absmax, stats.std AS std, stats.mean AS mean, stats.numel AS numel,
        coalesce(stats.nan_count, 0) AS nan_count, coalesce(stats.inf_count, 0) AS inf_count,
        stats.range[quant_type].max_normal AS max_normal,
        stats.range[quant_type].flush_to_zero_ratio AS flush,
        stats.range[quant_type].overflow_ratio AS overflow,
        stats.range[quant_type].underflow_ratio AS underflow,
        whatif IS NOT NULL AS has_whatif
        FROM {relation or source(state)}""")
    return NARROW


@dataclass
class Inputs:
    """What a kind's query reads, on either engine: the narrow table; the index's nested dataset
    (a relation; None when the folder holds a flight recorder's summaries alone); how many
    records and summary rows the narrow table holds; the report's rank_tables.RankView when it
    ran the outlier-rank test already. Then what the command line or the folder adds (None
    where it does not; tensor_viz.diagnose.READS says which kind reads what): the folder, its
    losses and where they came from, the reference (its connection, index and name on the
    command line), the auto-guard's folder, and the findings of the kinds that do not read
    findings (for the kinds that name the finding they follow)."""

    narrow: str
    nested: str | None
    records: int
    summary_rows: int = 0
    view: Any = None
    folder: Any = None
    losses: list[tuple[int, float]] | None = None
    loss_source: str = ""
    reference: tuple[Any, Any, str] | None = None
    guard: Any = None
    findings: list[RunFinding] | None = None


@dataclass
class NarrowState:
    """What tensor_viz.rank_tables needs of an index, pointing it at the narrow table (the same
    column names and the statistics its METRICS read)."""

    relation: str
    records: int


def _rows(con: Any, sql: str, params: list | None = None) -> list[dict[str, Any]]:
    cur = con.execute(sql, params or [])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


_NONFINITE = "(nan_count + inf_count)"
#: records whose mean and std merge (diagnose.reference_gap): finite statistics of a nonempty tensor
FINITE_MOMENTS = f"numel > 0 AND {_NONFINITE} = 0 AND isfinite(mean) AND isfinite(std)"
_NONFINITE_NESTED = "(coalesce(stats.nan_count, 0) + coalesce(stats.inf_count, 0))"
_COLS = ("rank, iteration, sample_idx, counter, layer_idx, module_path, operation, phase, "
         "tensor_name, quant_type, variant")


def _where(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec.get(k) for k in LOCATION_KEYS}


def _label(rec: dict[str, Any]) -> str:
    return (f"{rec.get('module_path') or 'L' + str(rec.get('layer_idx'))} {rec.get('operation')} "
            f"{rec.get('tensor_name')}")


# -- first_nonfinite -------------------------------------------------------------------------------
def first_nonfinite(con: Any, src: str) -> list[RunFinding]:
    """The earliest NaN/Inf in execution order (iteration, micro-batch, the capture's own order on
    its rank, then rank) and where it was born."""
    first_it = con.execute(f"SELECT min(iteration) FROM {src} WHERE {_NONFINITE} > 0").fetchone()[0]
    if first_it is None:
        return []
    recs = _rows(con, f"""
        WITH it AS (SELECT {_COLS}, {_NONFINITE} AS bad, nan_count AS nan,
                           inf_count AS inf, numel
                    FROM {src} WHERE iteration = ?),
        o AS (SELECT *, counter - min(counter) OVER (PARTITION BY rank, sample_idx) AS pos FROM it)
        SELECT * FROM o ORDER BY sample_idx NULLS FIRST, pos, rank""", [first_it])
    origin = next(r for r in recs if (r["bad"] or 0) > 0)
    same_run = [r for r in recs if r["rank"] == origin["rank"]
                and r["sample_idx"] == origin["sample_idx"]]
    born, previous = _birth(origin, same_run)
    kinds = "NaN" if origin["nan"] else "Inf"
    micro = (f"micro-batch {origin['sample_idx']}" if origin["sample_idx"] is not None else
             "micro-batches merged (a flight recorder summary: its ring dump or a replay names "
             "the micro-batch)")
    summary = (f"First {kinds}: iteration {origin['iteration']}, {micro}, rank "
               f"{origin['rank']}, {_label(origin)}; {born}.")
    evidence = _nonfinite_evidence(con, src, origin, same_run, previous)
    if born.startswith("born"):
        action = (f"Check {origin['module_path']}'s operands for overflow before the cast (the "
                  "range findings); rerun with this module in bf16 (a per-module recipe "
                  "override) to confirm; capture this iteration with tensors (stats_only: "
                  "false) to see the values.")
    else:
        action = ("Look at what runs between the two captured tensors (norm, activation, "
                  "residual add, communication); capture this iteration with tensors "
                  "(stats_only: false) to see the values.")
    return [RunFinding("first_nonfinite", HIGH, summary, _where(origin), evidence,
                       "index.html: Diagnosis; numerics_map (statistic nonfinite)", action,
                       onset=origin["iteration"], position=float(origin["pos"]))]


def _birth(origin: dict[str, Any], same_run: list[dict[str, Any]]
           ) -> tuple[str, dict[str, Any] | None]:
    """(where the first non-finite value was born, the finite record captured just before it)
    from the records of its rank and micro-batch in capture order."""
    before = [r for r in same_run if r["pos"] < origin["pos"]]
    inputs = [r for r in before if r["module_path"] == origin["module_path"]
              and r["operation"] == origin["operation"]]
    previous = before[-1] if before else None
    if origin["phase"] == "post" and inputs and all(not r["bad"] for r in inputs):
        born = (f"born in {origin['module_path']}'s {origin['operation']} (its inputs "
                f"{', '.join(r['tensor_name'] for r in inputs)} were finite)")
    elif previous is not None:
        born = (f"already non-finite where captured; the tensor captured just before it "
                f"({_label(previous)}) was finite, so it was produced in between")
    else:
        born = "non-finite in the first tensor captured in that micro-batch"
    return born, previous


def _nonfinite_evidence(con: Any, src: str, origin: dict[str, Any],
                        same_run: list[dict[str, Any]], previous: dict[str, Any] | None
                        ) -> dict[str, Any]:
    """first_nonfinite's numbers: the origin's counts, the record before it, and how far the
    non-finite values spread (records, modules, ranks, iterations)."""
    forward_finite = all(not r["bad"] for r in same_run if r["operation"] == "forward")
    spread = con.execute(f"""SELECT count(*), count(DISTINCT module_path), count(DISTINCT rank),
        count(DISTINCT iteration), max(iteration) FROM {src} WHERE {_NONFINITE} > 0""").fetchone()
    in_it = sum(1 for r in same_run if r["pos"] >= origin["pos"])
    bad_after = sum(1 for r in same_run if r["pos"] >= origin["pos"] and r["bad"])
    evidence = {
        "nan_count": origin["nan"], "inf_count": origin["inf"], "numel": origin["numel"],
        "quant_type": origin["quant_type"], "variant": origin["variant"],
        "previous_finite": _label(previous) if previous else None,
        "forward_of_this_micro_batch_finite": forward_finite,
        "spread": {"records": spread[0], "modules": spread[1], "ranks": spread[2],
                   "iterations": spread[3], "last_iteration": spread[4],
                   "after_origin_in_its_micro_batch": f"{bad_after} of {in_it} records"},
    }
    if origin["operation"] == "backward" and forward_finite:
        evidence["note"] = "the forward of this micro-batch was finite: the loss was finite"
    return evidence


# -- trends ------------------------------------------------------------------------------------
def fit(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """(slope per iteration, intercept, r^2) of a least-squares line through ``points``."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    syy = sum((p[1] - my) ** 2 for p in points)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in points)
    if sxx == 0:
        return 0.0, my, 0.0
    slope = sxy / sxx
    r2 = (sxy * sxy) / (sxx * syy) if syy > 0 else 0.0
    return slope, my - slope * mx, r2


def _severity_of_crossing(left: float, span: int, already: bool) -> str:
    if already or left <= HIGH_SPAN * span:
        return HIGH
    return MEDIUM if left <= MEDIUM_SPAN * span else LOW


@dataclass
class Trend:
    metric: str
    slope: float
    r2: float
    first: float
    last: float
    crossing: float | None       # projected iteration (None: no limit known)
    severity: str
    limit: float | None


def absmax_trend(series: list[tuple[int, float]], max_normal: float | None) -> Trend | None:
    """A steady rise of log2(absmax) toward the format's largest value (module docstring)."""
    pts = [(i, math.log2(v)) for i, v in series if v and v > 0 and math.isfinite(v)]
    if len(pts) < MIN_TREND_POINTS:
        return None
    slope, _, r2 = fit(pts)
    span = pts[-1][0] - pts[0][0]
    if slope <= 0 or r2 < MIN_R2 or pts[-1][1] - pts[0][1] < MIN_RISE_BINADES or span <= 0:
        return None
    crossing, sev = None, LOW
    if max_normal:
        head = math.log2(max_normal) - pts[-1][1]
        left = max(head, 0.0) / slope
        crossing = pts[-1][0] + left
        sev = _severity_of_crossing(left, span, head <= 0)
    return Trend("absmax", slope, r2, 2 ** pts[0][1], 2 ** pts[-1][1], crossing, sev, max_normal)


def ratio_trend(metric: str, series: list[tuple[int, float]]) -> Trend | None:
    """A steady rise of a flush / overflow ratio toward RATIO_LIMIT."""
    pts = [(i, v) for i, v in series if v is not None and math.isfinite(v)]
    if len(pts) < MIN_TREND_POINTS:
        return None
    slope, _, r2 = fit(pts)
    first, last = pts[0][1], pts[-1][1]
    span = pts[-1][0] - pts[0][0]
    if (slope <= 0 or r2 < MIN_R2 or last - first < MIN_RATIO_RISE
            or last < MIN_RATIO_FACTOR * first or span <= 0):
        return None
    left = max(RATIO_LIMIT - last, 0.0) / slope
    return Trend(metric, slope, r2, first, last, pts[-1][0] + left,
                 _severity_of_crossing(left, span, last >= RATIO_LIMIT), RATIO_LIMIT)


def _series_rows(con: Any, src: str) -> list[dict[str, Any]]:
    key = ", ".join(TENSOR_KEY)
    return _rows(con, f"""
        SELECT {key}, iteration, max(absmax) AS absmax, max(max_normal) AS max_normal,
               any_value(quant_type) AS quant_type
        FROM {src}
        WHERE variant = {SQL_HP} AND {_NONFINITE} = 0
        GROUP BY {key}, iteration ORDER BY iteration""")


def positions(con: Any, src: str) -> dict[tuple, float]:
    """Execution position of each tensor (TENSOR_KEY) in the first iteration of the lowest rank."""
    key = ", ".join(TENSOR_KEY)
    rows = con.execute(f"""
        WITH f AS (SELECT min(rank) AS r, min(iteration) AS i FROM {src})
        SELECT {key}, min(counter) FROM {src}, f WHERE rank = f.r AND iteration = f.i
        GROUP BY {key}""").fetchall()
    return {tuple(r[:-1]): float(r[-1]) for r in rows}


def range_drift(con: Any, src: str) -> list[RunFinding]:
    """Tensors whose absmax rises steadily toward the format's largest value; the tensors whose
    rise starts in the same iteration are one finding named by the upstream one."""
    series: dict[tuple, list[dict[str, Any]]] = {}
    for row in _series_rows(con, src):
        series.setdefault(tuple(row[k] for k in TENSOR_KEY), []).append(row)
    pos = positions(con, src)
    hits = []
    for key, rows in series.items():
        its = [r["iteration"] for r in rows]
        # the run format's flush / overflow ratios are run_format_loss's (level and trend, by
        # what the operand loses): here the magnitude alone
        trends = [absmax_trend(list(zip(its, [r["absmax"] for r in rows])),
                               rows[-1]["max_normal"])]
        trends = [t for t in trends if t is not None]
        if trends:
            worst = min(trends, key=lambda t: SEVERITY_ORDER[t.severity])
            hits.append((key, rows, worst, trends))
    groups: dict[int, list] = {}
    for hit in hits:
        groups.setdefault(hit[1][0]["iteration"], []).append(hit)
    out = []
    for onset, members in groups.items():
        members.sort(key=lambda h: pos.get(h[0], math.inf))
        key, rows, trend, trends = members[0]
        sev = min((h[2].severity for h in members), key=SEVERITY_ORDER.get)
        where = dict(zip(TENSOR_KEY, key), iteration=onset, rank=None, sample_idx=None)
        fmt = rows[-1]["quant_type"]
        cross = ("" if trend.crossing is None else
                 f", projected to reach {fmt}'s limit ({trend.limit:.4g}) at iteration "
                 f"{trend.crossing:.0f}")
        graded = min(members, key=lambda h: (SEVERITY_ORDER[h[2].severity],
                                              pos.get(h[0], math.inf)))
        why = ("" if graded is members[0] or graded[2].severity == trend.severity else
               f"; {graded[2].severity} from {_label(dict(zip(TENSOR_KEY, graded[0])))}'s "
               f"{graded[2].metric} {graded[2].first:.3g} -> {graded[2].last:.3g}")
        summary = (f"{_label(where)} drifts: {trend.metric} {trend.first:.3g} -> {trend.last:.3g} "
                   f"over iterations {onset}..{rows[-1]['iteration']}{cross}"
                   + (f"; {len(members) - 1} downstream tensor(s) drift with it" if len(members) > 1
                      else "") + why + ".")
        evidence = {"format": fmt, "trends": [_trend_dict(t) for t in trends],
                    "moves_with_it": [{"tensor": _label(dict(zip(TENSOR_KEY, h[0]))),
                                       "severity": h[2].severity, **_trend_dict(h[2])}
                                      for h in members[1:11]],
                    "moving_tensors": len(members),
                    "severity_from": _label(dict(zip(TENSOR_KEY, graded[0])))}
        action = (f"Look at what makes {_label(where)} grow (learning rate, weight decay, a "
                  f"missing norm); until then keep it out of {fmt} or give it a scale "
                  "(a per-tensor / block-scaled format) before it crosses.")
        out.append(RunFinding("range_drift", sev, summary, where, evidence,
                           "index.html: numerics_map (absmax over iterations); overflow_analysis",
                           action, onset=onset, position=pos.get(key, math.inf)))
    return out


def _trend_dict(t: Trend) -> dict[str, Any]:
    return {"metric": t.metric, "first": t.first, "last": t.last, "slope_per_iteration": t.slope,
            "r2": t.r2, "limit": t.limit, "projected_crossing_iteration": t.crossing}


# -- format_loss ---------------------------------------------------------------------------------
def format_loss(con: Any, inp: Inputs, run_formats: set[str],
                baseline: Callable[[str, tuple, int], float],
                severity: Callable[[float, float], str]) -> list[RunFinding]:
    """Per what-if format, the tensors whose SQNR falls below the format's Gaussian baseline by
    the margin of quant.format_loss; one finding per format (and per cast / not cast), named by
    its worst tensor. Only the GEMM operands (OPERANDS) of the formats the run computes in
    (``run_formats``) are graded above LOW: the run's format does not cast the others."""
    if inp.nested is None or not con.execute(
            f"SELECT count(*) FROM {inp.narrow} WHERE has_whatif").fetchone()[0]:
        return []
    per_format: dict[tuple[str, bool], list] = {}
    for r in _whatif_minima(con, inp.nested):
        at = r["at"]
        shape = tuple(at["shape"] or ()) or (1,)
        base = baseline(r["format"], shape, int(at["axis"] if at["axis"] is not None else -1))
        sev = severity(r["sqnr_db"], base)
        if sev == "none":
            continue
        cast = (r["operation"], r["tensor_name"]) in OPERANDS
        if (sev == "high" and OPERANDS.get((r["operation"], r["tensor_name"])) == "grad_output"
                and r["sqnr_db"] > GRADIENT_NOISE_DB):
            sev = "medium"      # a gradient above its quantization noise still trains
        per_format.setdefault((r["format"], cast), []).append((base - r["sqnr_db"], r, base, sev))
    out = []
    # rows come in each engine's own order: ties in deficit (two tensors flushed alike) are
    # broken by the tensor's key, and findings come per format in name order, on both engines
    for (fmt, cast), items in sorted(per_format.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        items.sort(key=lambda x: (-x[0], tuple(str(x[1][k]) for k in TENSOR_KEY)))
        out.append(_format_loss_finding(fmt, cast, items, fmt in run_formats))
    return out


def _whatif_minima(con: Any, nested: str) -> list[dict[str, Any]]:
    """Per tensor and what-if format, the least finite SQNR and where it was measured."""
    key = ", ".join(TENSOR_KEY)
    at = named_struct(con, {**{k: k for k in ("iteration", "rank", "sample_idx", "shape", "axis")},
                            "underflow": "f.value.underflow_ratio",
                            "flush": "f.value.flush_ratio"})
    # ties (the same SQNR on several ranks) broken alike on both engines: the earliest
    order = named_struct(con, {"s": "f.value.sqnr_db", "i": "iteration", "r": "rank",
                               "m": "coalesce(sample_idx, -1)"})
    return _rows(con, f"""
        WITH w AS (SELECT {key}, iteration, rank, sample_idx, shape, whatif.axis AS axis,
                          {dialect(con)['explode']}(map_entries(whatif.formats)) AS f
                   FROM {nested} WHERE whatif IS NOT NULL AND {_NONFINITE_NESTED} = 0)
        SELECT {key}, f.key AS format, min(f.value.sqnr_db) AS sqnr_db,
               min_by({at}, {order}) AS at
        FROM w WHERE f.value.sqnr_db IS NOT NULL AND isfinite(f.value.sqnr_db)
        GROUP BY {key}, f.key""")


def _format_loss_finding(fmt: str, cast: bool, items: list, run_format: bool) -> RunFinding:
    """format_loss' finding of one format (cast or not), named by its worst tensor (``items``:
    (deficit, row, baseline, severity), the worst first)."""
    deficit, r, base, sev = items[0]
    level = sev.upper() if run_format and cast else LOW
    where = {**{k: r[k] for k in TENSOR_KEY}, "iteration": r["at"]["iteration"],
             "rank": r["at"]["rank"], "sample_idx": r["at"]["sample_idx"]}
    summary = (f"{_label(where)} loses {deficit:.1f} dB more in {fmt} than Gaussian data of "
               f"its shape (SQNR {r['sqnr_db']:.1f} dB vs {base:.1f} dB)"
               + (f"; {len(items) - 1} other tensor(s) too" if len(items) > 1 else "")
               + ("" if not run_format or cast else
                  " (a tensor the run's format does not cast)")
               + ("" if run_format else " (a what-if format, not the run's)") + ".")
    evidence = {"format": fmt, "sqnr_db": r["sqnr_db"], "baseline_db": base,
                "deficit_db": deficit, "tensors_beyond_margin": len(items),
                "others": [{"tensor": _label(dict(zip(TENSOR_KEY, [x[1][k] for k in TENSOR_KEY]))),
                            "deficit_db": x[0]} for x in items[1:11]]}
    under = r["at"]["underflow"] or 0.0
    evidence.update(underflow_ratio=under, flush_ratio=r["at"]["flush"], cast=cast,
                    below_gradient_noise=r["sqnr_db"] < GRADIENT_NOISE_DB,
                    cause="range" if under >= UNDERFLOW_CAUSE else "precision")
    if under >= UNDERFLOW_CAUSE and where["operation"] == "backward":
        action = (f"{100 * under:.1f}% of {_label(where)} sits below {fmt}'s smallest normal: "
                  "scale the gradients (a loss scale) or give them a scaled format "
                  "(fp8_e4m3_tensor, mxfp8); a finer format does not help values the scale "
                  "leaves below the range; or keep this GEMM in high precision (a precision "
                  "plan).")
    elif under >= UNDERFLOW_CAUSE:
        action = (f"{100 * under:.1f}% of {_label(where)} sits below {fmt}'s smallest normal: "
                  "give it a scale (a per-tensor or block-scaled format) or keep it out of "
                  f"{fmt} (a precision plan).")
    else:
        action = (f"Keep {_label(where)} out of {fmt} (a per-module recipe override), or use "
                  "a format with finer scaling for it; the per-layer table ranks the formats.")
    return RunFinding("format_loss", level, summary, where, evidence,
                      "index.html: the per-layer quantization error table; whatif_numerics",
                      action, onset=r["at"]["iteration"])


# -- rank_outlier --------------------------------------------------------------------------------
def rank_outlier(con: Any, inp: Inputs) -> list[RunFinding]:
    """The report's outlier-rank test (tensor_viz.rank_tables, its one definition), one finding
    per rank and metric, over the narrow table: records and a flight recorder's summaries alike
    (their absmax from min / max, std from the mergeable sums, flush and saturation ratios from
    their counts); ``inp.view``: the report's RankView, when it ran the test already."""
    out = []
    view = inp.view
    if view is not None:
        rows = list(view.outliers) if view.header.ranks >= 3 else []
    else:
        if con.execute(f"SELECT count(DISTINCT rank) FROM {inp.narrow}").fetchone()[0] < 3:
            return []
        narrow = NarrowState(inp.narrow, inp.records + inp.summary_rows)
        rows = rank_tables.outlier_ranks(con, narrow, None, limit=10)
    for r in rows:
        metric = r["metric"]
        where = {"iteration": r["first_iteration"], "rank": r["rank"],
                 "layer_idx": r.get("layer_idx"), "module_path": r.get("module_path"),
                 "operation": r.get("operation"), "phase": r.get("phase"),
                 "tensor_name": r.get("tensor_name")}
        sev = HIGH if metric == "nonfinite" else MEDIUM
        layer = "" if r.get("layer_idx") is None else f"L{r['layer_idx']} "
        summary = (f"Rank {r['rank']} is an outlier in {metric} from iteration "
                   f"{r['first_iteration']} ({r['cells']} layer x tensor x iteration cells; "
                   f"worst z {r['worst_z']:.3g} at {layer}"
                   f"{r.get('submodule') or r.get('module_path') or ''} "
                   f"{r.get('tensor_name')}).")
        out.append(RunFinding("rank_outlier", sev, summary, where,
                           {"metric": metric, "cells": r["cells"], "worst_z": r["worst_z"],
                            "value": r.get("v"), "median": r.get("med"),
                            "submodule": r.get("submodule")},
                           "index.html: Outlier ranks; rank_analysis",
                           f"Compare rank {r['rank']}'s data shard and hardware with the "
                           "others (a bad node or a bad shard shows on one rank only).",
                           onset=r["first_iteration"]))
    return out


# -- attention_logit_growth ----------------------------------------------------------------------
def attention_logit_growth(con: Any, src: str) -> list[RunFinding]:
    """max |q.k|/sqrt(d) per layer over iterations, bounded from the captured query and key
    absmax: |q.k|/sqrt(d) <= sqrt(d) * absmax(q) * absmax(k) (d the head dimension)."""
    rows = _rows(con, f"""
        SELECT layer_idx, any_value(module_path) AS module_path, iteration,
               max(absmax) FILTER (WHERE tensor_name = 'query') AS q,
               max(absmax) FILTER (WHERE tensor_name = 'key') AS k,
               max(last_dim) FILTER (WHERE tensor_name = 'query') AS d
        FROM {src}
        WHERE tensor_name IN ('query', 'key') AND operation = 'forward' AND {_NONFINITE} = 0
        GROUP BY layer_idx, iteration ORDER BY iteration""")
    per_layer: dict[Any, list] = {}
    for r in rows:
        if r["q"] and r["k"] and r["d"]:
            per_layer.setdefault(r["layer_idx"], []).append(r)
    out = []
    for layer, rs in per_layer.items():
        series = [(r["iteration"], math.sqrt(r["d"]) * r["q"] * r["k"]) for r in rs]
        t = absmax_trend(series, None)
        if t is None:
            continue
        sev = HIGH if t.last >= LOGIT_HIGH else MEDIUM
        where = {"layer_idx": layer, "module_path": rs[0]["module_path"], "operation": "forward",
                 "tensor_name": "query", "iteration": rs[0]["iteration"], "phase": "pre"}
        out.append(RunFinding(
            "attention_logit_growth", sev,
            f"Layer {layer}'s attention logits grow: max |q.k|/sqrt(d) bound {t.first:.3g} -> "
            f"{t.last:.3g} over iterations {rs[0]['iteration']}..{rs[-1]['iteration']}.",
            where, {"bound_first": t.first, "bound_last": t.last, "slope_binades": t.slope,
                    "r2": t.r2, "head_dim": rs[0]["d"]},
            "index.html: attention_analysis; numerics_map",
            "Add qk-layernorm or lower the learning rate (the instability small proxy models "
            "reproduce at high learning rates).", onset=rs[0]["iteration"]))
    return out
