"""The auto-guard in one process: its settings (one line, exit-2 errors before training), its
ladder, and its judging on megatron-core's schedule interface (tensor_capture.numbering's wrapper
over a schedule of our own) with operands quantized through the emulation's own path. Runs of the
tiny Llama are in tests/test_guard_run.py."""
from __future__ import annotations

import json

import pytest
import torch

from quant.precision_plan import load_plan
from tensor_capture import emulation, numbering
from tensor_capture import saver as ts
from tensor_capture.config import ConfigError, load_config
from tensor_capture.guard import GUARD_DIR, operand_row
from tensor_capture.guard_rules import (
    CONDITIONS,
    ELEMENTS,
    FLUSHED,
    MADE_NONFINITE,
    NONZERO,
    SATURATED,
    ladder,
)


# -- settings ----------------------------------------------------------------------------------
def test_the_environment_turns_the_guard_and_the_recorder_on():
    c = load_config(env={"TENSOR_SAVE_GUARD": "on", "CUSTOM_QUANT_TYPE": "fp8_e4m3"})
    assert c.enabled and c.mode == "recorder" and c.guard.budget == 0.25 and c.guard.hold == 2
    assert load_config(env={"TENSOR_SAVE_GUARD": "off"}).guard is None


def test_settings_from_the_config_file(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("guard:\n  budget: 0.1\n  hold: 3\n  actions: [hp]\n"
                   "  conditions: {flush_share: null, sqnr_deficit_db: 10}\n")
    g = load_config(cfg, env={"CUSTOM_QUANT_TYPE": "mxfp8"}).guard
    assert (g.budget, g.hold, g.actions) == (0.1, 3, ("hp",))
    assert [c.name for c, _ in g.active()] == ["nonfinite", "saturation_share", "sqnr_deficit_db"]
    assert dict((c.name, t) for c, t in g.active())["sqnr_deficit_db"] == 10.0


@pytest.mark.parametrize("body, env, fragment", [
    ("guard:\n  budgets: 0.2\n", {"CUSTOM_QUANT_TYPE": "fp8_e4m3"},
     "guard: unknown key(s) budgets; known: budget, hold"),
    ("guard:\n  budget: 1.5\n", {"CUSTOM_QUANT_TYPE": "fp8_e4m3"},
     "guard.budget=1.5 must be a share of GEMM FLOPs from 0 to 1"),
    ("guard:\n  conditions: {flush: 0.1}\n", {"CUSTOM_QUANT_TYPE": "fp8_e4m3"},
     "unknown condition(s) flush"),
    ("guard:\n  actions: [scale]\n", {"CUSTOM_QUANT_TYPE": "hifp8"},
     "hifp8 has no scaled variant and actions ['scale'] exclude high precision"),
    ("guard: on\n", {}, "the guard acts on an emulated format; set CUSTOM_QUANT_TYPE"),
])
def test_bad_guard_settings_are_one_line(tmp_path, body, env, fragment):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_config(cfg, env=env)
    assert fragment in str(err.value) and str(cfg) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="TENSOR_SAVE_GUARD='maybe': use on or off"):
        load_config(env={"TENSOR_SAVE_GUARD": "maybe", "CUSTOM_QUANT_TYPE": "fp8_e4m3"})


def test_the_ladder_is_the_scaled_variants_cheapest_first_then_high_precision():
    both = ("scale", "hp")
    assert ladder("fp8_e4m3", both) == ["fp8_e4m3_tensor", "mxfp8", "hp"]
    assert ladder("fp8_e4m3_tensor", both) == ["mxfp8", "hp"]
    assert ladder("mxfp8", both) == ["hp"] and ladder("te_fp8_delayed", both) == ["hp"]
    assert ladder("fp8_e4m3", ("scale",)) == ["fp8_e4m3_tensor", "mxfp8"]
    assert ladder("hp", both) == []


# -- the statistics of one operand ----------------------------------------------------------------
def test_operand_statistics_follow_their_definitions():
    x = torch.tensor([0.0, 1e-4, -3e-3, 1.0, 500.0, float("inf"), -2.0, 1e-5])
    q = emulation.quantize(x, fmt="fp8_e4m3")              # unscaled: saturates at 448
    from quant.analysis import cast_limits

    row = operand_row(x, q, cast_limits("fp8_e4m3").overflow_bound(torch.float32)).tolist()
    finite = torch.isfinite(x)
    assert row[ELEMENTS] == 8 and row[NONZERO] == int((finite & (x != 0)).sum()) == 6
    assert row[FLUSHED] == int((finite & (x != 0) & (q == 0)).sum()) == 2   # 1e-4, 1e-5
    assert row[SATURATED] == 1 and row[MADE_NONFINITE] == 0                  # 500 -> 448
    by = {c.name: c for c in CONDITIONS}
    assert by["flush_share"].value(row, 30.0) == pytest.approx(2 / 6)
    assert by["saturation_share"].value(row, 30.0) == 1 / 8


@pytest.mark.parametrize("fmt, unscaled", [("fp8_e4m3", True), ("mxfp8", False),
                                            ("fp4_e2m1", True)])
def test_the_cpu_fast_path_gives_the_general_path_s_numbers(fmt, unscaled):
    from quant.analysis import cast_limits
    from tensor_capture.guard import _general_row

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-16, 10, (64, 96),
                                                                    generator=g).float())
    x[0, :5] = 0.0
    q = emulation.quantize(x, fmt=fmt)
    overflow = cast_limits(fmt).overflow_bound(torch.float32) if unscaled else None
    fast = operand_row(x, q, overflow)
    assert torch.equal(fast, _general_row(x.reshape(-1), q.reshape(-1), overflow))
    assert fast[FLUSHED] > 0 and (fast[SATURATED] > 0) == unscaled


# -- judging on the schedule interface ------------------------------------------------------------
HEALTHY, FLUSHING = "decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2"


def _steps(iterations: int, tiny_from: int = 0, micro: int = 2) -> list[torch.Tensor]:
    """``iterations`` schedule calls; each micro-batch quantizes the dgrad operands of fc1
    (grad_output N(0,1)) and fc2 (grad_output 1e-5 N(0,1), below e4m3's subnormals, from
    ``tiny_from``; the same weight for both) through the emulation, as the patched linear's
    backward does. Returns fc2's quantized grad_output of each micro-batch."""
    g = torch.Generator().manual_seed(0)
    seen: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        it = ts.get_tensor_saver().iteration
        big = torch.randn(64, 32, generator=g)
        small = torch.randn(64, 32, generator=g) * (1e-5 if it >= tiny_from else 1.0)
        weight = torch.randn(32, 16, generator=g)
        emulation.quantize_operand(big, "grad_output", "dgrad", site=HEALTHY, iteration=it)
        emulation.quantize_operand(weight, "weight", "dgrad", site=HEALTHY, iteration=it)
        seen.append(emulation.quantize_operand(small, "grad_output", "dgrad", site=FLUSHING,
                                               iteration=it))
        emulation.quantize_operand(weight, "weight", "dgrad", site=FLUSHING, iteration=it)
        return 1.0

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches,
                 forward_only=False):
        return [forward_step_func(data_iterator, model) for _ in range(num_microbatches)]

    step = numbering.wrap_schedule(schedule)
    for _ in range(iterations):
        step(forward_step_func=forward_step, data_iterator=None, model=[None],
             num_microbatches=micro)
    return seen


@pytest.fixture
def session(tmp_path):
    def start(quant="fp8_e4m3", **guard):
        cfg = tmp_path / "g.yaml"
        cfg.write_text("guard:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in guard.items())
                       if guard else "guard: on\n")
        return ts.configure(load_config(cfg, env={"CUSTOM_QUANT_TYPE": quant,
                                                  "TENSOR_SAVE_DIR": str(tmp_path)}))
    yield start
    ts.reset_tensor_saver()


def test_a_flushing_gemm_is_rescaled_once_the_condition_held(session, tmp_path, capsys):
    session()
    seen = _steps(6, tiny_from=2)
    saver = ts.get_tensor_saver()
    saver.close()
    lines = [json.loads(x) for x in (tmp_path / GUARD_DIR / "decisions.jsonl").read_text()
             .splitlines()]
    # the tiny gradients from iteration 2: held at 2 and 3 (hold 2), decided at 3
    assert [(d["iteration"], d["module"], d["gemm"], d["from"], d["to"]) for d in lines] == [
        (3, FLUSHING, "dgrad", "fp8_e4m3", "fp8_e4m3_tensor")]
    assert lines[0]["evidence"]["operand"] == "grad_output" and lines[0]["rule"] in (
        "sqnr_deficit_db", "flush_share")
    # applied from iteration 4 through the precision plan the emulation reads
    flushed = [bool((t == 0).all()) for t in seen]
    assert flushed == [False] * 4 + [True] * 4 + [False] * 4      # 2 micro-batches a step
    plan = load_plan(tmp_path / GUARD_DIR / "plan.yaml")
    assert plan.format_for(FLUSHING, 0, "dgrad") == "fp8_e4m3_tensor"
    assert plan.format_for(FLUSHING, 0, "wgrad") == "fp8_e4m3"
    assert plan.format_for(HEALTHY, 0, "dgrad") == "fp8_e4m3"
    summary = json.loads((tmp_path / GUARD_DIR / "summary.json").read_text())
    assert summary["decisions"] == 1 and summary["hp_flops_share"] == 0.0
    # the report's run timeline marks it (tensor_viz.plots_timeline), lowp-diagnose names it
    from tensor_viz.diagnose import diagnose
    from tensor_viz.plots_timeline import guard_steps

    assert guard_steps(tmp_path) == {3: "guard: 1 GEMM -> fp8_e4m3_tensor"}
    found = [f for f in diagnose(tmp_path).findings if f.kind == "guard_decision"]
    assert [(f.severity, f.onset, f.evidence["gemms"], f.evidence["to"]) for f in found] == [
        ("LOW", 3, [f"{FLUSHING} dgrad"], "fp8_e4m3_tensor")]
    err = capsys.readouterr().err
    assert err.count("tensor capture: guard: iteration 3:") == 1
    assert f"{FLUSHING} dgrad fp8_e4m3 -> fp8_e4m3_tensor from iteration 4" in err


def test_a_healthy_run_gets_no_decision_and_the_same_numbers(session, tmp_path):
    session("mxfp8")
    guarded = _steps(5)
    ts.get_tensor_saver().close()
    ts.reset_tensor_saver()
    ts.configure(load_config(env={"CUSTOM_QUANT_TYPE": "mxfp8"}))
    plain = _steps(5)
    assert all(torch.equal(a, b) for a, b in zip(guarded, plain)) and len(plain) == 10
    assert not (tmp_path / GUARD_DIR / "decisions.jsonl").exists()
    assert json.loads((tmp_path / GUARD_DIR / "summary.json").read_text())["decisions"] == 0


def test_high_precision_is_refused_beyond_the_budget(session, tmp_path, capsys):
    # only hp allowed and a zero budget: the guard says once that nothing is left, decides nothing
    session(actions=["hp"], budget=0.0)
    _steps(6, tiny_from=0)
    ts.get_tensor_saver().close()
    assert not (tmp_path / GUARD_DIR / "decisions.jsonl").exists()
    err = capsys.readouterr().err
    assert err.count(f"guard: {FLUSHING} dgrad still fails") == 1
    assert "no cheaper rung is left within the budget (0% of GEMM FLOPs" in err


def test_within_the_budget_the_failing_gemm_goes_to_high_precision(session, tmp_path):
    # the two GEMMs have equal FLOPs: half the FLOPs fit a budget of 0.5, not of 0.4
    session(actions=["hp"], budget=0.5)
    _steps(4, tiny_from=0)
    ts.get_tensor_saver().close()
    summary = json.loads((tmp_path / GUARD_DIR / "summary.json").read_text())
    assert summary["final"] == {f"{FLUSHING} dgrad": "hp"}
    assert summary["hp_flops_share"] == pytest.approx(0.5)
    from tensor_viz.diagnose import diagnose

    (found,) = [f for f in diagnose(tmp_path).findings if f.kind == "guard_decision"]
    assert found.severity == "MEDIUM" and "in high precision" in found.action


def test_a_resumed_run_keeps_the_decisions_taken_before_it(session, tmp_path, capsys):
    session()
    _steps(6, tiny_from=0)                         # decided at iteration 1
    ts.get_tensor_saver().close()
    ts.reset_tensor_saver()
    cfg = tmp_path / "g.yaml"
    ts.configure(load_config(cfg, env={"CUSTOM_QUANT_TYPE": "fp8_e4m3",
                                       "TENSOR_SAVE_DIR": str(tmp_path),
                                       "TENSOR_SAVER_ITERATION": "4"}))
    seen = _steps(1, tiny_from=0)
    assert not any(bool((t == 0).all()) for t in seen)      # rescaled from its first step
    assert "guard: resumed at iteration 4 with 1 earlier decision(s)" in capsys.readouterr().err


def test_a_replay_of_a_guarded_run_keeps_the_guard_in_capture_mode(tmp_path):
    """The recorder's replay file writes the run's settings back as YAML: the guard's read back
    the same, and the replay's explicit capture mode stays capture."""
    from tensor_capture.recorder.replay import _config_yaml

    c = load_config(env={"TENSOR_SAVE_GUARD": "on", "CUSTOM_QUANT_TYPE": "fp8_e4m3"})
    path = tmp_path / "replay.yaml"
    path.write_text(_config_yaml(c, 3, 5, tmp_path / "replay"))
    again = load_config(path, env={})
    assert again.guard == c.guard and again.mode == "capture" and again.enabled
