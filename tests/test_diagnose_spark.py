"""``lowp-diagnose --engine spark`` (pyspark in local mode, one session for the module): every kind
DuckDB runs, on a capture (the columnar index's Parquet dataset), on a flight recorder's
summaries alone and on records with summaries beside them, gives the same findings (kind, rank,
iteration, module, severity) as DuckDB on the same folder. One diagnosis per folder and engine;
each kind is then checked on its own (DuckDB must find what was planted, so no parity holds by
finding nothing)."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_diagnose import _ORDER, write_capture

from tensor_capture import schema
from tensor_viz.diagnose import KINDS, diagnose
from tensor_viz.diagnose import cli as diagnose_cli
from tensor_viz.diagnose import spark as diagnose_spark

pyspark = pytest.importorskip("pyspark", reason="pyspark not installed (pip install -e "
                              "'.[spark]'; .ci/run installs it)")
if diagnose_spark._java() is None:
    pytest.skip("no Java runtime (apt-get install default-jre-headless; .ci/run installs it)",
                allow_module_level=True)

RANKS, OUTLIER_RANK, NAN_RANK = 4, 2, 1
FC1 = "decoder.layers.0.mlp.linear_fc1"


@pytest.fixture(scope="module")
def spark():
    """The one session of the module: diagnose(engine="spark") finds it active and leaves it."""
    session, started = diagnose_spark.session("local[1]")      # small data: one task at a time
    assert started
    session.conf.set("spark.sql.shuffle.partitions", "1")
    yield session
    session.stop()


def _change(rec):
    """One capture with a cause for every kind: a NaN born in a backward (rank 1, iteration 3),
    a weight drifting 2 binades per iteration, one rank's input gradients 50 x the others' from
    iteration 2, a gradient the run's format flushes more every iteration, a gradient a what-if format
    loses, and attention logits growing."""
    it, rank, path, name = rec["iteration"], rec["rank"], rec["module_path"], rec["tensor_name"]
    if it == 3 and rank == NAN_RANK and rec["sample_idx"] == 1 and rec["operation"] == "backward":
        rec["stats"]["nan_count"] = 2
    if path == FC1 and name == "weight":
        rec["stats"]["absmax"] = 0.5 * 4.0 ** it
        rec["stats"]["std"] = rec["stats"]["absmax"] / 3     # and departs from the reference
    if rank == OUTLIER_RANK and it >= 2 and name == "grad_input":
        rec["stats"]["absmax"] *= 50
    if path == FC1 and name == "grad_output":
        rec["stats"]["range"]["hifp8"]["flush_to_zero_ratio"] = 0.001 * (1 + it)
    if name == "grad_output" and rec["layer_idx"] == 1:
        rec["whatif"] = {"axis": -1, "axis_source": "gemm", "elements": 1024, "sampled": False,
                         "formats": {"hifp8": {"sqnr_db": 3.0, "rel_error": 0.5,
                                               "overflow_ratio": 0.0, "underflow_ratio": 0.9,
                                               "flush_ratio": 0.0, "axis": -1}}}
    if name in ("output", "input") and path.endswith("linear_qkv"):
        rec = _attention(rec)
        rec["stats"] = dict(rec["stats"], absmax=2.0 * 1.5 ** it)
    return rec


def _attention(rec):
    """linear_qkv's output and input recorded as core attention's query and key (the model of
    the capture and of its reference)."""
    if rec["tensor_name"] in ("output", "input") and rec["module_path"].endswith("linear_qkv"):
        rec = dict(rec, tensor_name="query" if rec["tensor_name"] == "output" else "key",
                   shape=[16, 2, 4, 16],
                   module_path=rec["module_path"].replace("linear_qkv", "core_attention"))
    return rec


OUTPUT = "output_layer"
_SUMMARY_SITES = [*_ORDER, (OUTPUT, None, "forward", "post", "output")]


def write_summaries(folder, iterations=10, fmt="fp8_e4m3"):
    """A flight recorder's summary files (schema.REC_SUMMARY_COLUMNS, one per rank): a NaN on
    rank 1 at iteration 7, layer 0 fc1's weight doubling every iteration, rank 2's input
    gradients 50 x the others' from iteration 4, layer 0 fc1's gradient wholly flushed by the run's format;
    and the output layer (no layer index: a cell with a NULL column) 1000 x on rank 2 from
    iteration 6, which both engines must score like any other cell."""
    d = folder / schema.RECORDER_DIR
    d.mkdir(parents=True, exist_ok=True)
    for rank in range(RANKS):
        rows = []
        for it in range(iterations):
            for site, (path, layer, op, phase, name) in enumerate(_SUMMARY_SITES):
                a = 1.0 + 0.01 * ((site * 7 + rank) % 5)
                if path == OUTPUT and rank == OUTLIER_RANK and it >= 6:
                    a *= 1000
                if path == FC1 and name == "weight":
                    a = 0.5 * 2.0 ** it
                if rank == OUTLIER_RANK and it >= 4 and name == "grad_input":
                    a *= 50
                n = 2048
                rows.append({
                    "iteration": it, "rank": rank, "site": site, "module_path": path,
                    "layer_type": "linear", "layer_idx": layer, "operation": op, "phase": phase,
                    "tensor_name": name, "variant": "hp", "quant_type": fmt, "micro_batches": 2,
                    "count": n, "sum": 0.0, "sumsq": n * (a / 3) ** 2, "min": -a, "max": a,
                    "nan_count": 3 if (rank, it, path, name) == (NAN_RANK, 7, FC1, "input")
                    else 0, "inf_count": 0,
                    "flush_count": n if (path, name) == (FC1, "grad_output") else 0,
                    "saturation_count": 0})
        pq.write_table(pa.Table.from_pylist(rows), d / schema.recorder_summary_name(rank, 0))
        # the loss the recorder saw: falling, then a spike at the last iteration
        (d / schema.recorder_loss_name(rank)).write_text("".join(json.dumps(
            {"iteration": it, "rank": rank, "loss": 40.0 if it == iterations - 1 else
             6.0 - 0.1 * it}) + "\n" for it in range(iterations)))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("spark_parity")
    capture = write_capture(root / "capture", ranks=RANKS, change=_change)
    summaries = write_summaries(root / "summaries")
    both = write_summaries(write_capture(root / "both", ranks=RANKS))     # records cover 0..4
    return {"capture": capture, "summaries": summaries, "both": both}


@pytest.fixture(scope="module")
def results(folders, spark, tmp_path_factory):
    """(DuckDB's JSON, Spark's JSON) per folder; the summaries' through the command."""
    # the capture against a healthy one of the same model: reference_gap on both engines
    ref = {"reference": write_capture(tmp_path_factory.mktemp("ref") / "ref", ranks=RANKS,
                                      change=_attention)}
    out = {name: (diagnose(folder, **(ref if name == "capture" else {})).to_json(),
                  diagnose(folder, engine="spark", **(ref if name == "capture" else {})).to_json())
           for name, folder in folders.items() if name != "summaries"}
    written = tmp_path_factory.mktemp("spark_json") / "d.json"
    assert diagnose_cli.main([str(folders["summaries"]), "--engine", "spark", "--json",
                              str(written)]) == 0
    out["summaries"] = (diagnose(folders["summaries"]).to_json(),
                        json.loads(written.read_text(encoding="utf-8")))
    return out


def _key(f):
    return (f["kind"], f["rank"], f["iteration"], f["module_path"], f["severity"])


#: kind -> the folders DuckDB must find it in (the planted cause; the reference is the
#: capture's, the losses the recorder's; "recorder" says what it read and finds nothing itself;
#: no folder holds an auto-guard's decisions)
FOUND_IN = {"first_nonfinite": ("capture", "summaries", "both"),
            "run_format_loss": ("capture", "summaries", "both"),
            "range_drift": ("capture", "summaries", "both"),
            "format_loss": ("capture",), "attention_logit_growth": ("capture",),  # records
            "rank_outlier": ("capture", "summaries", "both"),
            "recorder": (), "loss_spike": ("summaries", "both"),
            "loss_divergence": ("summaries", "both"), "reference_gap": ("capture",),
            "guard_decision": ()}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_gives_duckdb_s_findings_on_spark(results, kind):
    assert set(FOUND_IN) == set(KINDS)
    for name, (duck, spark) in results.items():
        mine = [_key(f) for f in duck["findings"] if f["kind"] == kind]
        theirs = [_key(f) for f in spark["findings"] if f["kind"] == kind]
        assert theirs == mine, name
        assert bool(mine) == (name in FOUND_IN[kind]), (name, mine)
        assert spark["checked"].get(kind) == duck["checked"].get(kind)
        same = [f for f in duck["findings"] if f["kind"] == kind]
        assert [f["summary"] for f in spark["findings"] if f["kind"] == kind] == [
            f["summary"] for f in same]
        assert [f["evidence"].get("follows") for f in spark["findings"] if f["kind"] == kind] \
            == [f["evidence"].get("follows") for f in same]


def test_the_whole_diagnosis_is_the_same_ranked_list(results):
    for name, (duck, spark) in results.items():
        assert [_key(f) for f in spark["findings"]] == [_key(f) for f in duck["findings"]], name
        assert (spark["records"], spark["summary_rows"]) == (duck["records"],
                                                            duck["summary_rows"])
        assert set(spark["checked"]) == set(duck["checked"])
    # the planted faults, from the summaries alone: the NaN's rank and iteration, the outlier
    duck, _ = results["summaries"]
    (nan,) = [f for f in duck["findings"] if f["kind"] == "first_nonfinite"]
    assert (nan["rank"], nan["iteration"], nan["module_path"]) == (NAN_RANK, 7, FC1)
    outliers = [f for f in duck["findings"] if f["kind"] == "rank_outlier"]
    assert {f["rank"] for f in outliers if f["severity"] != "HIGH"} == {OUTLIER_RANK}
    assert OUTPUT in {f["module_path"] for f in outliers}      # its NULL layer index scored too
    assert duck["checked"]["format_loss"].startswith("not checked: needs what-if numerics")
    # records where they exist, summaries beyond them
    duck, _ = results["both"]
    assert duck["records"] == 800 and duck["summary_rows"] == RANKS * 5 * len(_SUMMARY_SITES)

