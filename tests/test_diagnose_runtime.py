"""lowp-diagnose on real captures: the tiny Llama driven by megatron-core's schedule on 2 ranks,
stats-only capture of every iteration, with a NaN planted in a forward input, a NaN planted in an
output gradient (on rank 1), a weight grown each iteration under hifp8 emulation, and a healthy
mxfp8-emulated run (tests/diagnose_helpers.py; all four in one pair of processes).
"""
from __future__ import annotations

import json
import math

import pytest
from diagnose_helpers import (
    GROWN,
    ITERATIONS,
    NAN_ITERATION,
    PLANTS,
    run_diagnose_scenarios,
)

from tensor_capture.patcher import prepare_patched_megatron
from tensor_viz.diagnose import cli as diagnose_cli
from tensor_viz.diagnose import diagnose


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    patched = str(prepare_patched_megatron(tmp_path_factory.mktemp("patched")))
    out = tmp_path_factory.mktemp("diagnose")
    return run_diagnose_scenarios(patched, out), out


def _module_layer(path: str) -> int:
    return int(path.split(".")[2])


@pytest.mark.parametrize("scen, operation, tensor", [("nan_forward", "forward", "input"),
                                                      ("nan_backward", "backward", "grad_output")])
def test_a_planted_nan_is_the_first_finding_where_it_was_planted(runs, scen, operation, tensor):
    results, out = runs
    rank, module, iteration, micro = PLANTS[scen]
    first = diagnose(out / scen).findings[0].to_dict()
    assert (first["kind"], first["severity"]) == ("first_nonfinite", "HIGH")
    assert (first["iteration"], first["sample_idx"], first["rank"]) == (iteration, micro, rank)
    assert (first["module_path"], first["layer_idx"]) == (module, _module_layer(module))
    assert (first["operation"], first["tensor_name"]) == (operation, tensor)
    assert first["evidence"]["nan_count"] >= 1 and first["evidence"]["spread"]["records"] > 1
    if scen == "nan_backward":
        # the loss of that micro-batch was finite: the NaN was born in the backward
        assert math.isfinite(results[rank][f"loss_{scen}"][iteration][micro])
        assert first["evidence"]["forward_of_this_micro_batch_finite"] is True
    else:
        assert iteration == NAN_ITERATION
        assert not math.isfinite(results[rank][f"loss_{scen}"][iteration][micro])


def test_a_weight_grown_each_iteration_under_hifp8_is_the_first_drift(runs):
    _, out = runs
    findings = diagnose(out / "growth").findings
    # hifp8 without a loss scale flushes small gradients from the first iteration (a real cause
    # of its own, not planted): when it is there it comes first, the planted growth next
    lead = findings[0].to_dict()
    assert lead["kind"] in ("range_drift", "run_format_loss")
    if lead["kind"] == "run_format_loss":
        assert (lead["tensor_name"], lead["iteration"]) == ("grad_output", 0)
    # hifp8 flushes elements of the gradients but next to none of their energy: not HIGH
    assert not [f for f in findings if f.kind == "run_format_loss" and f.severity == "HIGH"
                and f.where["operation"] == "backward"]
    first = next(f for f in findings if f.kind == "range_drift").to_dict()
    assert findings.index(next(f for f in findings if f.kind == "range_drift")) <= 1
    assert (first["kind"], first["module_path"], first["layer_idx"]) == (
        "range_drift", GROWN, _module_layer(GROWN))
    assert (first["operation"], first["tensor_name"]) == ("forward", "weight")
    assert first["evidence"]["format"] == "hifp8"
    assert first["evidence"]["moving_tensors"] > 1          # what it feeds is folded into it
    crossing = first["evidence"]["trends"][0]["projected_crossing_iteration"]
    assert crossing is not None and crossing > ITERATIONS - 1


def test_a_healthy_emulated_run_has_no_high_finding_and_says_what_was_checked(runs, capsys):
    _, out = runs
    rc = diagnose_cli.main([str(out / "healthy"), "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["records"] > 0
    assert not [f for f in data["findings"] if f["severity"] == "HIGH"], data["findings"][:3]
    # a gradient that mostly sits below a format's smallest normal needs a scale, not a finer
    # format: the what-if hifp8 loses backward tensors to its range
    ranged = [f for f in data["findings"] if f["kind"] == "format_loss"
              and f["operation"] == "backward" and f["evidence"]["underflow_ratio"] >= 0.5]
    assert ranged and all(f["evidence"]["cause"] == "range" and "loss scale" in f["action"]
                          for f in ranged)
    assert {"first_nonfinite", "range_drift", "format_loss", "rank_outlier",
            "attention_logit_growth"} <= set(data["checked"])


def test_the_warning_comes_once_per_module_operand_and_format(runs):
    results, _ = runs
    said_per_run = {}
    for scen in ("growth", "healthy"):
        heads = [ln for ln in results[0][f"stderr_{scen}"].splitlines()
                 if ln.startswith("tensor capture: iteration ")]
        levels: dict[str, list[str]] = {}
        for h in heads:
            assert " dB " in h and "severity" in h or "back within the margin" in h, h
            key = h.split(": ", 2)[1].split(", ", 1)[1]         # "KIND MODULE"
            level = ("NONE" if "back within the margin" in h
                     else h.split("severity ")[1].split(";")[0].split(",")[0])
            levels.setdefault(key, []).append(level)
        for key, said in levels.items():                      # again only when the level changes
            assert all(a != b for a, b in zip(said, said[1:])), (key, said)
        said_per_run[scen] = [lv for said in levels.values() for lv in said]
    # hifp8 without loss scaling loses bits on small gradients and says so; the healthy mxfp8
    # run has nothing HIGH to say, as its diagnosis
    assert said_per_run["growth"]
    assert "HIGH" not in said_per_run["healthy"]
