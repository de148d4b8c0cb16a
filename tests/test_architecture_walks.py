"""docs/architecture.md's "Where to add things", walked: each extension is added the way the page
says, in the one place it names, and then works end to end. (The scaling family and the diagnosis
kind are walked beside their peers: tests/test_quant_families.py and tests/test_diagnose.py.)"""
from __future__ import annotations

import math

import numpy as np
import torch
from error_bounds import merged_moments_error_bounds

from tensor_capture import schema, stats_read
from tensor_capture.saver import TensorSaver
from training_profiler import watch_training
from training_profiler.monitor import judging as monitor_judging
from training_profiler.monitor.judging import Signal


def _captured_records(tmp_path, tensors: list[torch.Tensor]) -> list[dict]:
    saver = TensorSaver(enabled=True, save_dir=str(tmp_path))
    for i, x in enumerate(tensors):
        saver.save_tensor(x, "linear", "forward", tensor_name="input", layer_idx=i)
    saver.close()
    return list(schema.read_manifest(tmp_path))


def test_a_derived_capture_statistic_is_one_function_over_what_records_store(tmp_path) -> None:
    """A statistic that follows from the stored stats is one function (as in stats_read); capture
    is not touched. Here: the share of a tensor's nonzero elements below 2^-k, and the std of two
    captured tensors taken together, both from the records alone, against the tensors."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.logspace(-7, 2, 48, base=2.0)
    a = torch.randn(32, 48, generator=gen) * scale
    b = torch.randn(16, 48, generator=gen) * 3 + 1
    recs = _captured_records(tmp_path, [a, b])

    def share_below(stats: dict, bound: float) -> float:   # the new statistic: one function
        return stats_read.fraction_below(stats["log2_hist"], bound)

    for k in (-6, -3, 0, 2):
        nz = a[a != 0].abs()
        brute = float((nz < 2.0 ** k).sum()) / nz.numel()
        assert share_below(recs[0]["stats"], 2.0 ** k) == brute, k

    parts = [(r["stats"]["numel"], r["stats"]["mean"], r["stats"]["std"]) for r in recs]
    n, mean, std = stats_read.merge_moments(parts)
    both = torch.cat([a.flatten(), b.flatten()]).double()
    assert n == both.numel()
    d_mean, d_std = merged_moments_error_bounds([a, b])
    assert abs(mean - float(both.mean())) <= d_mean
    assert abs(std - float(both.std())) <= d_std
    naive = sum(p[2] for p in parts) / len(parts)   # what an average of std would say
    assert not math.isclose(naive, std, rel_tol=1e-2)


def test_a_monitor_signal_is_one_row_of_signals(monkeypatch) -> None:
    """A Signal row added to monitor_judging.SIGNALS alone gets its threshold, is judged, named
    in its alert and kept in the history: nothing else is edited."""
    new = Signal("loss_drop", lambda m, v: None if v.loss is None else -v.loss,
                 dict(direction="down"), record="loss_drop", note="loss fell away from its baseline")
    monkeypatch.setattr(monitor_judging, "SIGNALS", monitor_judging.SIGNALS + (new,))

    rng = np.random.default_rng(0)
    losses = np.linspace(3.0, 2.0, 200) * (1 + 0.02 * rng.standard_normal(200))
    losses[150] *= 1.6

    @watch_training(sinks=[], warmup_steps=60)
    def step(value: float) -> torch.Tensor:
        return torch.tensor(value)

    for v in losses:
        step(float(v))
    step.monitor.close()
    mine = [a for a in step.monitor.alerts if a["metric"] == "loss_drop"]
    assert [a["step"] for a in mine] == [151]
    assert "loss fell away from its baseline" in mine[0]["message"]
    assert "loss_drop" in step.monitor.thresholds
    kept = [h["loss_drop"] for h in step.monitor.history if "loss_drop" in h]
    assert len(kept) == len(losses) and kept[150] == -float(torch.tensor(float(losses[150])))


def test_a_capture_setting_is_one_field_with_its_parser_and_variable(tmp_path, monkeypatch) -> None:
    """docs/architecture.md "A capture setting": a CaptureConfig field declared with
    ``setting(default, parser, env)`` alone is read from YAML and from its environment variable
    (the variable wins), checked by its parser (one line naming the variable), and listed among
    the known settings: no parser table, env-key list or constant is edited."""
    from dataclasses import make_dataclass

    import pytest

    from tensor_capture import config

    def hold(name: str, value) -> int:                  # the new setting's parser
        n = int(str(value).strip())
        if n < 1:
            raise config.ConfigError(f"{name}={n} must be >= 1")
        return n

    new = make_dataclass("CaptureConfig", [("flush_hold", int, config.setting(5, hold, "TENSOR_SAVE_FLUSH_HOLD"))],
                         bases=(config.CaptureConfig,), frozen=True)
    monkeypatch.setattr(config, "CaptureConfig", new)
    yaml_file = tmp_path / "capture.yaml"
    yaml_file.write_text("flush_hold: 7\nstats_only: true\n")

    assert config.load_config(env={}).flush_hold == 5
    from_yaml = config.load_config(yaml_file, env={})
    assert (from_yaml.flush_hold, from_yaml.stats_only) == (7, True)
    assert config.load_config(yaml_file, env={"TENSOR_SAVE_FLUSH_HOLD": " 9 "}).flush_hold == 9
    assert config.load_config(env={}, flush_hold="3").flush_hold == 3
    with pytest.raises(config.ConfigError, match=r"^tensor capture: TENSOR_SAVE_FLUSH_HOLD=0 must be >= 1"):
        config.load_config(yaml_file, env={"TENSOR_SAVE_FLUSH_HOLD": "0"})
    yaml_file.write_text("flush_holt: 7\n")
    with pytest.raises(config.ConfigError, match=r"unknown capture setting\(s\) \['flush_holt'\]; known: .*'flush_hold'"):
        config.load_config(yaml_file, env={})


def test_a_recipe_is_one_factory_of_role_quantizers(monkeypatch) -> None:
    """docs/architecture.md, *A recipe*: a recipe is a factory role -> quantizer; registered in
    RECIPES it runs through quantize_operand, its summary records each role's quantizer, and a
    precision plan takes its name. Here: MXFP8 for the forward operands, E5M2 current scaling for
    the gradients, each role's values equal to the TE recipe that uses that quantizer."""
    import pytest

    from quant import recipes
    from quant.precision_plan import plan_from_dict
    from quant.quantizer import Quantizer
    from quant.role_quantizers import CurrentScaling, MXFP8Scaling

    mx = MXFP8Scaling(Quantizer.of("fp8_e4m3"), (1, 32), multiple=32)
    grads = CurrentScaling(Quantizer.of("fp8_e5m2"))

    def factory(role: tuple[str, str]):
        return grads if role[0] == "grad_output" else mx

    recipe = recipes.Recipe("walk_mx_fwd", "MXFP8 forward, E5M2 gradients", factory)
    monkeypatch.setitem(recipes.RECIPES, recipe.name, recipe)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 40
    for tensor, gemm in recipes.ROLES:
        same_as = "te_fp8_tensorwise" if tensor == "grad_output" else "te_mxfp8"
        got = recipes.quantize_operand(x, "walk_mx_fwd", tensor, gemm)
        want = recipes.quantize_operand(x, same_as, tensor, gemm)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (tensor, gemm)
        assert not torch.equal(got, x)
    kinds = {role: s["kind"] for role, s in recipe.summary().items()}
    assert kinds["grad_output/wgrad"] == "tensor_current" and kinds["input/fprop"] == "mxfp8"
    assert recipe.summary()["grad_output/dgrad"]["element"] == "fp8_e5m2"
    with pytest.raises(ValueError, match=r"walk_mx_fwd needs a multiple of 32"):
        recipes.quantize_operand(torch.ones(4, 40), "walk_mx_fwd", "input", "fprop")
    plan = plan_from_dict({"rules": [{"modules": "fc2", "roles": ["wgrad"],
                                      "format": "WALK_MX_FWD"}]})
    assert plan.format_for("layers.0.mlp.fc2", 0, "wgrad") == "walk_mx_fwd"


def test_a_recorder_trigger_is_one_row_of_triggers(tmp_path, monkeypatch) -> None:
    """docs/architecture.md, "A recorder trigger": a Trigger row added to triggers.TRIGGERS alone
    is judged on a real recorder session, agreed, announced, and fires once (re-armed by a clean
    iteration): its trigger record, ring and replay file are written."""
    from tensor_capture import numbering
    from tensor_capture import saver as ts
    from tensor_capture.recorder import read as recorder_read
    from tensor_capture.recorder import triggers
    from tensor_capture.recorder.stats import MAX

    limit = 100.0

    def max_above(rules, seen):           # the new trigger: a site's largest value above limit
        book, entry = seen.stats
        hot = [s for s in range(len(entry.seen)) if entry.seen[s] and entry.stats[s, MAX] > limit]
        if not hot:
            return None
        site = book.sites[book.slot_site[hot[0]]].site
        return {"tensor_name": site.tensor_name, "max": float(entry.stats[hot[0], MAX])}

    monkeypatch.setattr(triggers, "TRIGGERS",
                        triggers.TRIGGERS + (triggers.Trigger("max_above", max_above, ("stats",)),))
    ts.configure(enabled=True, save_dir=str(tmp_path), mode="recorder", recorder_window=3,
                 recorder_trigger_iterations=2, recorder_summary_every=4, recorder_warmup=3)
    try:
        saver = ts.get_tensor_saver()
        g = torch.Generator().manual_seed(0)
        for it in range(12):
            saver.set_iteration(it)
            for i in range(2):
                x = torch.randn(64, generator=g)
                if it in (5, 6) and i == 1:          # two iterations in a row: one trigger
                    x[3] = 500.0
                saver.capture(x, schema.CaptureSite(
                    layer_type="linear", operation="forward", phase="pre", tensor_name=f"t{i}",
                    module_path=f"decoder.layers.{i}.mlp", layer_idx=i, component="linear"))
            numbering.end_iteration(saver, it)
        saver.close()
    finally:
        ts.reset_tensor_saver()
    (t,) = recorder_read.read_triggers(tmp_path)
    assert (t["iteration"], t["kinds"], t["ring"]) == (5, ["max_above"], [3, 5])
    assert t["details"]["max_above"] == {"tensor_name": "t1", "max": 500.0}
    assert "max_above" in triggers.agreed_kinds()
    assert sorted({r["iteration"] for r in schema.read_manifest(tmp_path)}) == [3, 4, 5, 6, 7]
    assert [r["iteration"] for r in recorder_read.read_replays(tmp_path)] == [5]


def test_a_run_time_audit_rule_is_one_row_of_rules(monkeypatch) -> None:
    """docs/architecture.md, "A run-time audit rule": an AuditRule row added to RULES alone is
    judged over the record of a real audited step and reported, with its severity and fix, at
    the user's line, through the static checker's formats."""
    import inspect

    from quant.vocabulary import LOW_PRECISION_DTYPES, Severity
    from training_profiler.audit import format_findings, precision_audit
    from training_profiler.audit import rules as audit_rules

    def lowp_matmul(rec):                 # the new rule: a linear layer's GEMM in low precision
        for s in rec.sites.values():
            if s.phase == "forward" and s.op in ("mm", "addmm") and any(
                    d in LOW_PRECISION_DTYPES for d in s.out_dtypes):
                yield s.where, f"{s.op} returned {'/'.join(s.out_dtypes)} in {s.module}"

    rule = audit_rules.AuditRule("AUD900", "lowp-matmul", Severity.LOW,
                                 "a GEMM whose output is float16/bfloat16", "nothing: a walk",
                                 lowp_matmul)
    monkeypatch.setattr(audit_rules, "RULES", audit_rules.RULES + (rule,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with precision_audit() as audit:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            line = inspect.currentframe().f_lineno + 1
            out = model(x)                                   # the user's line
        out.sum().float().backward()
    mine = [f for f in audit.findings if f.rule_id == "AUD900"]
    assert {(f.path, f.line) for f in mine} == {(__file__, line)}
    assert mine[0].severity == Severity.LOW and "addmm returned bfloat16" in mine[0].message
    assert "AUD900" in format_findings(mine)
    with precision_audit() as plain:                         # a float32 step: no hit
        model(x).sum().backward()
    assert not [f for f in plain.findings if f.rule_id == "AUD900"]
