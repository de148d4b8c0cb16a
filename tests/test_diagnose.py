"""lowp-diagnose on hand-built manifests: each kind's rule, the ranking, the JSON schema and bad
input (the real-capture scenarios are in test_diagnose_runtime.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tensor_capture import schema
from tensor_viz.diagnose import cli as diagnose_cli
from tensor_viz.diagnose import diagnose
from tensor_viz.diagnose.rules import LOCATION_KEYS

#: one micro-batch of a 2-layer model, in the order a capture records it
_ORDER = [(f"decoder.layers.{layer}.{sub}", layer, op, phase, name)
          for op, layers in (("forward", (0, 1)), ("backward", (1, 0)))
          for layer in layers
          for sub in ("self_attention.linear_qkv", "mlp.linear_fc1")
          for phase, name in ((("pre", "input"), ("pre", "weight"), ("post", "output"))
                              if op == "forward" else
                              (("pre", "grad_output"), ("post", "grad_input")))]


def _record(rank, it, sample, counter, path, layer, op, phase, name, absmax=1.0, nan=0,
            fmt="hifp8", flush=0.0):
    return {"layer_type": "linear", "operation": op, "tensor_name": name, "quant_type": fmt,
            "layer_idx": layer, "phase": phase, "component": "linear", "iteration": it,
            "rank": rank, "sample_idx": sample, "counter": counter, "schema_version": 3,
            "shape": [16, 64], "module_path": path, "submodule": path.rsplit(".", 1)[-1],
            "variant": "hp", "emulated_format": fmt, "file": None,
            "stats": {"numel": 1024, "absmax": absmax, "mean": 0.0, "std": absmax / 3,
                      "nan_count": nan,
                      "inf_count": 0, "range": {fmt: {"max_normal": 32768.0, "min_normal": 3e-5,
                                                      "overflow_ratio": 0.0, "underflow_ratio": 0.0,
                                                      "flush_to_zero_ratio": flush}}}}


def write_capture(folder: Path, ranks=1, iterations=5, micro=2, change=None) -> Path:
    """A capture of ``ranks`` x ``iterations`` x ``micro`` micro-batches; ``change(rec)`` may
    edit each record (returning it)."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        lines, counter = [], 0
        for it in range(iterations):
            for s in range(micro):
                for path, layer, op, phase, name in _ORDER:
                    counter += 1
                    rec = _record(rank, it, s, counter, path, layer, op, phase, name,
                                  absmax=1.0 + 0.01 * ((counter * 7) % 5))
                    lines.append(json.dumps(change(rec) if change else rec))
        (folder / f"manifest_rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_a_healthy_capture_says_so_and_lists_what_was_checked(tmp_path, capsys):
    cap = write_capture(tmp_path / "ok")
    assert diagnose_cli.main([str(cap)]) == 0
    out = capsys.readouterr().out
    assert "healthy: no finding in 200 records" in out and "checked: first_nonfinite" in out


def test_first_nonfinite_is_the_earliest_in_execution_order_across_ranks(tmp_path):
    # rank 1's NaN comes earlier in its micro-batch than rank 0's, same iteration and micro-batch
    def change(rec):
        if rec["iteration"] == 3 and rec["sample_idx"] == 1:
            late = rec["rank"] == 0 and rec["module_path"].startswith("decoder.layers.1.")
            early = rec["rank"] == 1 and (rec["module_path"], rec["tensor_name"]) == (
                "decoder.layers.0.mlp.linear_fc1", "output")
            spread = rec["rank"] == 1 and rec["operation"] == "backward"
            if late or early or spread:
                rec["stats"]["nan_count"] = 3
        return rec

    cap = write_capture(tmp_path / "nan", ranks=2, change=change)
    result = diagnose(cap)
    f = result.findings[0].to_dict()
    assert (f["kind"], f["severity"], f["rank"], f["iteration"], f["sample_idx"]) == (
        "first_nonfinite", "HIGH", 1, 3, 1)
    assert (f["module_path"], f["operation"], f["tensor_name"]) == (
        "decoder.layers.0.mlp.linear_fc1", "forward", "output")
    assert "born in decoder.layers.0.mlp.linear_fc1's forward" in f["summary"]
    assert f["evidence"]["spread"]["ranks"] == 2
    assert list(f)[:2] == ["kind", "severity"] and set(LOCATION_KEYS) <= set(f)
    assert set(LOCATION_KEYS) - {schema.META_MODULE_PATH} <= set(schema.NAME_FIELDS)


def test_range_drift_names_the_upstream_tensor_and_projects_the_crossing(tmp_path):
    def change(rec):
        if rec["module_path"] == "decoder.layers.1.mlp.linear_fc1" and rec["tensor_name"] in (
                "weight", "output"):
            rec["stats"]["absmax"] = 0.5 * 4.0 ** rec["iteration"]     # 2 binades per iteration
        return rec

    f = diagnose(write_capture(tmp_path / "drift", change=change)).findings[0].to_dict()
    assert (f["kind"], f["module_path"], f["tensor_name"]) == (
        "range_drift", "decoder.layers.1.mlp.linear_fc1", "weight")
    trend = f["evidence"]["trends"][0]
    # absmax 128 at iteration 4, 2 binades per iteration to 32768 (8 binades): iteration 8
    assert trend["projected_crossing_iteration"] == pytest.approx(8.0)
    assert f["evidence"]["moving_tensors"] == 2 and f["severity"] == "HIGH"


def test_a_rising_gradient_flush_is_the_run_formats_with_its_trend(tmp_path):
    def change(rec):
        if rec["module_path"] == "decoder.layers.0.mlp.linear_fc1" and rec["tensor_name"] == "grad_output":
            rec["stats"]["range"]["hifp8"]["flush_to_zero_ratio"] = 0.001 * (1 + rec["iteration"])
        return rec

    fs = diagnose(write_capture(tmp_path / "flush", change=change)).findings
    # 0.2 % flushed from iteration 1 (above quant.analysis' 0.1 %), rising 0.1 % per iteration:
    # one finding (range_drift judges the magnitude only), with the projection to 1 %
    assert [f.kind for f in fs] == ["run_format_loss"]
    f = fs[0]
    assert (f.severity, f.onset, f.where["tensor_name"]) == ("MEDIUM", 1, "grad_output")
    assert f.evidence["gemms"] == ["dgrad", "wgrad"]
    assert f.evidence["trend"]["projected_crossing_iteration"] == pytest.approx(9.0)


def test_rank_outlier_and_attention_logit_growth(tmp_path):
    def change(rec):
        if rec["rank"] == 2 and rec["iteration"] >= 2:
            rec["stats"]["absmax"] *= 50
        return rec

    fs = diagnose(write_capture(tmp_path / "ranks", ranks=4, change=change)).findings
    outliers = [f for f in fs if f.kind == "rank_outlier"]
    assert outliers and {f.where["rank"] for f in outliers} == {2}
    assert {f.where["iteration"] for f in outliers} == {2}

    def qk(rec):
        if rec["tensor_name"] == "output" and rec["module_path"].endswith("linear_qkv"):
            rec = dict(rec, tensor_name="query", module_path=rec["module_path"].replace(
                "linear_qkv", "core_attention"), shape=[16, 2, 4, 16])
            rec["stats"] = dict(rec["stats"], absmax=2.0 * 1.5 ** rec["iteration"])
        return rec

    def both(rec):
        rec = qk(rec)
        if rec["tensor_name"] == "input" and rec["module_path"].endswith("linear_qkv"):
            rec = dict(rec, tensor_name="key", module_path=rec["module_path"].replace(
                "linear_qkv", "core_attention"), shape=[16, 2, 4, 16])
            rec["stats"] = dict(rec["stats"], absmax=2.0 * 1.5 ** rec["iteration"])
        return rec

    fs = diagnose(write_capture(tmp_path / "logits", change=both)).findings
    growth = [f for f in fs if f.kind == "attention_logit_growth"]
    assert {f.where["layer_idx"] for f in growth} == {0, 1}
    # sqrt(16) * (2 * 1.5^4)^2 at iteration 4
    assert growth[0].evidence["bound_last"] == pytest.approx(4 * (2 * 1.5 ** 4) ** 2)


def test_a_loss_spike_names_the_finding_it_follows(tmp_path):
    def change(rec):
        if rec["iteration"] == 3 and rec["tensor_name"] == "grad_input":
            rec["stats"]["nan_count"] = 1
        return rec

    cap = write_capture(tmp_path / "spike", change=change)
    log = tmp_path / "train.log"
    log.write_text("".join(f" iteration {i:>4}/ 100 | lm loss: {v:.6E} |\n"
                           for i, v in enumerate([3.0 - 0.01 * i for i in range(3)] + [math.nan])))
    res = diagnose(cap, loss=log)
    spikes = [f for f in res.findings if f.kind == "loss_spike"]
    assert len(spikes) == 1 and spikes[0].where["iteration"] == 3
    assert spikes[0].evidence["follows"]["kind"] == "first_nonfinite"
    assert res.findings[0].kind == "first_nonfinite"                   # the cause first


def test_json_schema_and_atomic_output(tmp_path, capsys):
    cap = write_capture(tmp_path / "c")
    out = tmp_path / "d.json"
    assert diagnose_cli.main([str(cap), "--json", str(out)]) == 0
    assert "healthy" in capsys.readouterr().out               # the text too
    data = json.loads(out.read_text())
    assert set(data) == {"findings", "checked", "records", "summary_rows"}
    assert data["records"] == 200 and data["summary_rows"] == 0   # no flight recorder here
    assert diagnose_cli.main([str(cap), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == data        # '-': the JSON alone on stdout


def _one_line_exit_2(capsys, argv, *fragments):
    with pytest.raises(SystemExit) if argv and argv[0].startswith("--bogus") else _nothing():
        rc = diagnose_cli.main(argv)
        assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lowp-diagnose: error: "), err
    for frag in fragments:
        assert frag in err[0], err[0]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path, capsys):
    out = tmp_path / "out.json"
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_exit_2(capsys, [str(empty), "--json", str(out)], "no manifest_rank*.jsonl",
                     "TENSOR_SAVE_DIR")
    _one_line_exit_2(capsys, [str(tmp_path / "missing")], "no such folder")
    torn = write_capture(tmp_path / "torn")
    text = (torn / "manifest_rank0.jsonl").read_text().splitlines()
    text[5] = text[5][:40]                                   # a torn line in the middle
    (torn / "manifest_rank0.jsonl").write_text("\n".join(text) + "\n")
    _one_line_exit_2(capsys, [str(torn), "--json", str(out)], "manifest_rank0.jsonl:6",
                     "--skip-bad-lines")
    assert diagnose_cli.main([str(torn), "--skip-bad-lines"]) == 0
    capsys.readouterr()
    other = write_capture(tmp_path / "other", change=lambda r: dict(
        r, module_path=r["module_path"].replace("decoder.layers", "encoder.blocks")))
    _one_line_exit_2(capsys, [str(write_capture(tmp_path / "mine")), "--reference", str(other),
                              "--json", str(out)], "--reference", "another model")
    _one_line_exit_2(capsys, [str(torn), "--json", str(tmp_path / "no" / "x.json")], "--json")
    assert not out.exists() and not list(tmp_path.glob(".out.json*"))


def test_a_reference_of_the_same_model_gives_the_first_departure(tmp_path):
    ref = write_capture(tmp_path / "ref")

    def change(rec):
        if rec["iteration"] >= 2 and rec["module_path"] == "decoder.layers.1.mlp.linear_fc1":
            rec["stats"]["std"] *= 2
        return rec

    fs = diagnose(write_capture(tmp_path / "run", change=change), reference=ref).findings
    gap = [f for f in fs if f.kind == "reference_gap"]
    assert gap and (gap[0].where["iteration"], gap[0].where["module_path"],
                    gap[0].where["tensor_name"]) == (2, "decoder.layers.1.mlp.linear_fc1", "input")


def test_the_report_and_the_one_click_output_open_with_the_diagnosis(tmp_path, capsys):
    from tensor_viz import cli

    def change(rec):
        if rec["iteration"] == 1 and rec["tensor_name"] == "output" and rec["layer_idx"] == 1:
            rec["stats"]["nan_count"] = 2
        return rec

    cap = write_capture(tmp_path / "cap", iterations=2, micro=1, change=change)
    out = tmp_path / "draw"
    # what one-click runs (visualize-tensors), with one section to keep it short
    assert cli.run(["--tensor_dir", str(cap), "--output_dir", str(out), "--workers", "1",
                    "--no-progress", "--whatif", ""], prog="visualize-tensors",
                   sections=("overflow_analysis",), quick=False, report=True,
                   description="") == 0
    printed = capsys.readouterr().out
    assert "1. [HIGH] first_nonfinite: First NaN: iteration 1" in printed
    page = (out / "index.html").read_text()
    at = page.index("<h2 id=diagnosis>Diagnosis</h2>")
    assert at < page.index("<h2 id=summary>") and at < page.index("<figure")
    assert "first_nonfinite" in page[at:page.index("<h2 id=summary>")]
    assert "decoder.layers.1.self_attention.linear_qkv forward output" in page


def test_cataloguing_runs_no_diagnosis_and_the_report_runs_it_once(tmp_path, monkeypatch):
    """The catalog says where the tensors are and judges nothing: building it never enters
    tensor_viz.diagnose, nor does the quick view; the report diagnoses once and shows it."""
    from tensor_viz import diagnose as diagnose_mod
    from tensor_viz import pipeline

    def change(rec):
        if rec["iteration"] == 1 and rec["tensor_name"] == "output" and rec["layer_idx"] == 1:
            rec["stats"]["nan_count"] = 2
        return rec

    cap = write_capture(tmp_path / "cap", iterations=2, micro=1, change=change)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return diagnose(*args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("cataloguing ran the diagnosis")

    opts = pipeline.Options(workers=1, progress=False, whatif=())
    monkeypatch.setattr(diagnose_mod, "diagnose", refused)
    catalog, _, _ = pipeline.load(cap, opts)
    assert catalog.index is not None and catalog.index.state.records == len(catalog.entries) > 0
    pipeline.build(cap, tmp_path / "quick", (), opts, quick=True, report=False)

    monkeypatch.setattr(diagnose_mod, "diagnose", counted)
    result = pipeline.build(cap, tmp_path / "out", ("overflow_analysis",), opts)
    assert len(calls) == 1 and result.diagnosis.findings[0].kind == "first_nonfinite"
    page = (tmp_path / "out" / "index.html").read_text()
    at = page.index("<h2 id=diagnosis>Diagnosis</h2>")
    assert "first_nonfinite" in page[at:page.index("<h2 id=summary>")]


def test_the_report_tables_mark_a_cell_by_the_same_judgment():
    from quant.format_loss import baseline_sqnr
    from tensor_viz.report import _loss_mark

    base = baseline_sqnr("hifp8", (16, 64), -1)
    cell = {"format": "hifp8", "shape": [16, 64], "axis": -1}
    assert _loss_mark(dict(cell, sqnr_db=base - 1)) == ""
    assert _loss_mark(dict(cell, sqnr_db=base - 8)).endswith("below Gaussian: MEDIUM)")
    assert _loss_mark(dict(cell, sqnr_db=base - 20)) == " (20.0 dB below Gaussian: HIGH)"


def test_a_merged_std_is_the_std_of_the_concatenated_tensors(tmp_path):
    import duckdb
    import torch
    from error_bounds import merged_moments_error_bounds

    from tensor_capture.stats import tensor_stats
    from tensor_capture.stats_read import merge_moments, merged_std_sql

    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(n, generator=gen) * s + m
             for n, s, m in ((4096, 1.0, 0.0), (300, 0.2, 3.0), (1000, 5.0, -2.0), (7, 1e-3, 1.0))]
    whole = torch.cat(parts).double()
    st = [tensor_stats(p) for p in parts]
    rows = [(s["numel"], s["mean"], s["std"]) for s in st]
    n, mean, std = merge_moments(rows)
    d_mean, d_std = merged_moments_error_bounds(parts)
    assert n == whole.numel() and abs(mean - whole.mean().item()) <= d_mean
    assert abs(std - whole.std().item()) <= d_std
    con = duckdb.connect()
    con.execute("CREATE TABLE t (numel BIGINT, mean DOUBLE, std DOUBLE)")
    con.executemany("INSERT INTO t VALUES (?, ?, ?)", rows)
    assert con.execute(f"SELECT {merged_std_sql()} FROM t").fetchone()[0] == pytest.approx(std)
    # what reference_gap used to compute is another number
    assert abs(sum(r[2] for r in rows) / len(rows) - whole.std().item()) > 0.5


def test_reference_gap_sees_micro_batches_that_move_apart(tmp_path):
    # same std in every micro-batch, means moving apart from iteration 2: the union's std grows
    def change(rec):
        if rec["iteration"] >= 2 and rec["tensor_name"] == "output":
            rec["stats"]["mean"] = 3.0 if rec["sample_idx"] else -3.0
        return rec

    ref = write_capture(tmp_path / "ref")
    fs = diagnose(write_capture(tmp_path / "run", change=change), reference=ref).findings
    gap = [f for f in fs if f.kind == "reference_gap"]
    assert gap and (gap[0].where["iteration"], gap[0].where["tensor_name"]) == (2, "output")


def test_loss_divergence_by_level():
    from tensor_viz.diagnose import first_cause
    from tensor_viz.diagnose.loss import divergence

    def loss_divergence(losses, others, vocab):
        return divergence(losses, others, vocab, first_cause)

    falling = [(i, 6.0 - 0.1 * i) for i in range(1, 20)]
    assert loss_divergence(falling, [], 384) == []
    up = [(1, 6.0), (2, 6.3), (3, 9.2), (4, 20.0), (5, 30.0)]
    (f,) = loss_divergence(up, [], None)
    assert (f.kind, f.severity, f.onset) == ("loss_divergence", "HIGH", 3)    # 9.2 > 1.5 x 6.0
    (f,) = loss_divergence([(i, 9.5) for i in range(1, 4)], [], 384)          # 1.5 ln 384 = 8.9
    assert f.onset == 1 and "ln(vocabulary 384)" in f.evidence["rule"]
    (f,) = loss_divergence([(i, 6.0 + 0.01 * (i % 3)) for i in range(1, 20)], [], 384)
    assert (f.severity, f.evidence["not_decreasing"]) == ("MEDIUM", True)
    # a jump the run recovers from is a spike, not a level: then judged as a plateau or not
    recovers = [(1, 6.0), (2, 17.0), (3, 12.0)] + [(i, 5.0 - 0.05 * i) for i in range(4, 40)]
    assert loss_divergence(recovers, [], 384) == []
    (f,) = loss_divergence(recovers[:3] + [(i, 5.0) for i in range(4, 40)], [], 384)
    assert (f.severity, f.evidence["not_decreasing"], f.onset) == ("MEDIUM", True, 4)


def test_the_run_format_operands_are_the_operands_the_format_casts():
    from quant.gemm_plan import PLAN
    from tensor_viz.diagnose.formats import OPERANDS, gemms

    assert {OPERANDS[k] for k in OPERANDS} == {p.operand for p in PLAN}
    assert gemms("forward", "input") == ["fprop", "wgrad"]
    assert gemms("backward", "grad_output") == ["dgrad", "wgrad"]
    assert gemms("backward", "weight") == ["dgrad"] and gemms("forward", "weight") == ["fprop"]


def test_the_rank_table_merges_a_ranks_micro_batches_by_their_moments(tmp_path):
    # rank 2's two micro-batches keep every std but move their means apart from iteration 2:
    # the std of that rank's data grows (an average of the stds would not move)
    def change(rec):
        if rec["rank"] == 2 and rec["iteration"] >= 2 and rec["tensor_name"] == "output":
            rec["stats"]["mean"] = 2.0 if rec["sample_idx"] else -2.0
        return rec

    fs = diagnose(write_capture(tmp_path / "ranks", ranks=4, change=change)).findings
    std = [f for f in fs if f.kind == "rank_outlier" and f.evidence["metric"] == "std"]
    assert std and {f.where["rank"] for f in std} == {2}
    assert {f.where["iteration"] for f in std} == {2}


@pytest.mark.parametrize("sqnr, level", [(14.0, "MEDIUM"), (2.0, "HIGH")])
def test_format_loss_grades_a_gradient_by_its_quantization_noise(tmp_path, sqnr, level):
    # hifp8's Gaussian baseline is ~31.5 dB: 14 dB is 17.5 dB under it (beyond the 15 dB of
    # HIGH), yet a gradient above sqrt(3) x its noise (4.77 dB) still trains; 2 dB does not.
    # A tensor the run's format does not cast (grad_input) is at most LOW, however bad.
    def change(rec):
        if rec["tensor_name"] in ("grad_output", "grad_input") and rec["layer_idx"] == 1:
            rec["whatif"] = {"axis": -1, "axis_source": "gemm", "elements": 1024,
                             "sampled": False,
                             "formats": {"hifp8": {"sqnr_db": sqnr, "rel_error": 0.1,
                                                   "overflow_ratio": 0.0, "underflow_ratio": 0.9,
                                                   "flush_ratio": 0.0, "axis": -1}}}
        return rec

    fs = [f for f in diagnose(write_capture(tmp_path / "w", change=change)).findings
          if f.kind == "format_loss"]
    by_tensor = {f.where["tensor_name"]: f for f in fs}
    grad = by_tensor["grad_output"]
    assert grad.severity == level and grad.evidence["below_gradient_noise"] == (level == "HIGH")
    assert grad.evidence["cause"] == "range" and "loss scale" in grad.action
    assert by_tensor["grad_input"].severity == "LOW" and not by_tensor["grad_input"].evidence["cast"]


def test_a_new_kind_is_one_entry_in_kinds_with_each_backend_s_query(tmp_path, monkeypatch, capsys):
    """docs/architecture.md, "A diagnosis kind": one ``Kind`` in ``tensor_viz.diagnose.KINDS``
    (what it checked, its DuckDB query, its Spark query) and lowp-diagnose, the report's
    Diagnosis section and the Spark runner all run it; its parameter is bound by the engine."""
    from tensor_viz import diagnose as dg
    from tensor_viz.diagnose.rules import MEDIUM, RunFinding

    limit = 1.5

    def above(con, src):
        rows = con.execute(f"SELECT module_path, min(iteration) FROM {src} WHERE absmax > ? "
                           "GROUP BY module_path ORDER BY module_path", [limit]).fetchall()
        return [RunFinding("absmax_above", MEDIUM, f"{m}: absmax above {limit}",
                        {"module_path": m}, onset=it) for m, it in rows]

    def query(con, inputs):             # both engines: the narrow table's name in inputs
        return above(con, inputs.narrow)

    monkeypatch.setitem(dg.KINDS, "absmax_above", dg.Kind(f"absmax above {limit}", query,
                                                         spark=query))
    def change(rec):
        if rec["module_path"] == "decoder.layers.1.mlp.linear_fc1" and rec["iteration"] >= 2:
            rec["stats"]["absmax"] = 3.0
        return rec

    cap = write_capture(tmp_path / "cap", change=change)
    want = sorted({r["module_path"] for r in schema.read_manifest(cap)
                   if r["stats"]["absmax"] > limit})
    result = diagnose(cap)
    assert result.checked["absmax_above"] == f"absmax above {limit}"
    got = sorted(f.where["module_path"] for f in result.findings if f.kind == "absmax_above")
    assert got == want and 0 < len(got) < len({r["module_path"] for r in schema.read_manifest(cap)})
    assert dg.KINDS["absmax_above"].spark is query     # --engine spark runs the same query
    assert diagnose_cli.main([str(cap)]) == 0
    assert "absmax_above" in capsys.readouterr().out


def test_engine_spark_without_pyspark_or_java_is_one_line_naming_the_install(
        tmp_path, capsys, monkeypatch):
    import sys

    cap = write_capture(tmp_path / "cap")
    out = tmp_path / "d.json"
    monkeypatch.setitem(sys.modules, "pyspark", None)            # import pyspark fails
    monkeypatch.setitem(sys.modules, "pyspark.sql", None)
    _one_line_exit_2(capsys, [str(cap), "--engine", "spark", "--json", str(out)],
                     "--engine spark: pyspark is not installed", 'pip install -e ".[spark]"',
                     "Java runtime")
    monkeypatch.undo()
    pytest.importorskip("pyspark")
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no_java_here"))
    _one_line_exit_2(capsys, [str(cap), "--engine", "spark"], "no Java runtime",
                     "no java on PATH", 'pip install -e ".[spark]" plus a Java runtime')
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    _one_line_exit_2(capsys, [str(cap), "--engine", "spark"], f"JAVA_HOME={tmp_path} has no "
                     "bin/java")
    _one_line_exit_2(capsys, [str(cap), "--spark-master", "local[1]"],
                     "--spark-master: only with --engine spark")
    assert not out.exists() and not (cap / ".tensor_index").exists()   # refused before work
