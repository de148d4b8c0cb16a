"""Precision plans (quant.precision_plan): matching, bad input, and every reader of one schema:
the capture emulation (CUSTOM_QUANT_PLAN), the TE factory's role rules, Megatron-LM's
per-module precision config, llama-train's check that each rule matches a GEMM."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from attribution import megatron_config
from lowp_common import UserError
from quant.precision_plan import PlanError, PlanSite, dump_plan, load_plan, plan_from_dict
from te_integration import factory
from tensor_capture import emulation
from tensor_capture.config import ConfigError, load_config
from tensor_capture.state import STATE

QKV0 = "decoder.layers.0.self_attention.linear_qkv"
FC2_3 = "decoder.layers.3.mlp.linear_fc2"


def _plan(*rules, default=None):
    raw = {"rules": list(rules)}
    if default:
        raw["default"] = default
    return plan_from_dict(raw, "test.yaml")


def test_first_matching_rule_wins_over_later_ones_and_the_default():
    plan = _plan({"modules": r"mlp\.linear_fc2$", "layers": [3], "roles": ["wgrad"],
                  "format": "bf16"},
                 {"modules": r"mlp\.", "format": "mxfp4"},
                 {"layers": "0-1", "roles": ["dgrad", "wgrad"], "format": "hp"},
                 default="fp8_e4m3")
    assert plan.format_for(FC2_3, 3, "wgrad") == "bf16"          # rule 1
    assert plan.format_for(FC2_3, 3, "fprop") == "mxfp4"         # rule 2: rule 1 is wgrad only
    assert plan.format_for(FC2_3, 2, "wgrad") == "mxfp4"         # layer 2: not rule 1
    assert plan.format_for(QKV0, 0, "dgrad") == "hp"             # rule 3 (range 0-1)
    assert plan.format_for(QKV0, 0, "fprop") == "fp8_e4m3"       # no rule: the plan's default
    assert plan.format_for("output_layer", None, "dgrad") == "fp8_e4m3"   # layers never match it
    no_default = _plan({"modules": "qkv", "format": "bf16"})
    assert no_default.format_for(FC2_3, 3, "fprop", default="mxfp8") == "mxfp8"


def test_layer_ranges_and_role_lists_are_parsed_and_round_trip_through_yaml(tmp_path):
    plan = _plan({"layers": [0, "2-4"], "roles": ["wgrad", "dgrad"], "format": "BF16"},
                 default="mxfp4")
    rule = plan.rules[0]
    assert rule.layers == frozenset({0, 2, 3, 4}) and rule.roles == ("dgrad", "wgrad")
    assert rule.fmt == "bf16"
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(plan, "a header\nline two"))
    again = load_plan(path)
    assert again.rules == plan.rules and again.default == plan.default
    assert path.read_text().startswith("# a header\n# line two\n")


@pytest.mark.parametrize("raw, message", [
    ({"rules": [{"format": "fp9"}]}, "format='fp9' is not a known format"),
    ({"rules": [{"roles": ["forward"], "format": "bf16"}]}, "forward GEMM is called fprop"),
    ({"rules": [{"roles": ["qk"], "format": "bf16"}]}, "GEMM role 'qk' is unknown"),
    ({"rules": [{"operands": ["output"], "format": "bf16"}]},
     "operand 'output' is unknown; use input, weight, grad_output"),
    ({"rules": [{"operands": [], "format": "bf16"}]}, "operands is empty"),
    ({"rules": [{"layers": ["3-1"], "format": "bf16"}]}, "layers '3-1'"),
    ({"rules": [{"modules": "(", "format": "bf16"}]}, "not a regular expression"),
    ({"rules": [{"module": "x", "format": "bf16"}]}, "unknown key(s) module"),
    ({"rules": [{"modules": "x"}]}, "no format"),
    ({"rules": []}, "no rules and no default"),
    ({"default": "nope"}, "format='nope' is not a known format"),
    (["bf16"], "a precision plan is a mapping"),
])
def test_bad_plans_are_one_line_naming_the_file_and_the_fix(raw, message):
    with pytest.raises(PlanError) as exc:
        plan_from_dict(raw, "bad.yaml")
    text = str(exc.value)
    assert message in text and text.startswith("bad.yaml") and "\n" not in text


def test_an_operands_rule_matches_the_operand_named_or_a_gemm_that_reads_one(tmp_path):
    """A caller naming the operand (the TE factory) gets the rule for that operand only; a
    caller naming none (a whole GEMM: the megatron-core emulation) gets it for each GEMM that
    reads one of the rule's operands (quant.gemm_plan): grad_output is read by dgrad and wgrad."""
    plan = _plan({"operands": ["grad_output"], "format": "fp8_e5m2"},
                 {"modules": "fc2", "operands": "weight", "roles": ["dgrad"], "format": "hp"},
                 default="mxfp8")
    assert plan.format_for(FC2_3, 3, "dgrad", operand="grad_output") == "fp8_e5m2"
    assert plan.format_for(FC2_3, 3, "dgrad", operand="weight") == "hp"          # rule 2
    assert plan.format_for(QKV0, 0, "dgrad", operand="weight") == "mxfp8"       # not fc2
    assert plan.format_for(FC2_3, 3, "fprop", operand="weight") == "mxfp8"      # not dgrad
    assert plan.format_for(FC2_3, 3, "wgrad", operand="input") == "mxfp8"
    whole = {role: plan.format_for(QKV0, 0, role) for role in ("fprop", "dgrad", "wgrad")}
    assert whole == {"fprop": "mxfp8", "dgrad": "fp8_e5m2", "wgrad": "fp8_e5m2"}
    assert plan.rule_for(QKV0, 0, "fprop") is None
    assert plan.format_for(FC2_3, 3, "fprop") == "mxfp8"          # fprop reads no grad_output
    path = tmp_path / "ops.yaml"
    path.write_text(dump_plan(plan))
    again = load_plan(path)
    assert again.rules == plan.rules and again.rules[1].operands == ("weight",)
    assert "operands" not in _plan({"format": "bf16"}).to_dict()["rules"][0]


def test_a_rule_that_matches_no_gemm_of_the_model_is_refused():
    sites = [PlanSite(QKV0, 0), PlanSite("decoder.layers.0.self_attention.core_attention", 0,
                                         ("fprop",)), PlanSite("output_layer", None)]
    _plan({"modules": "qkv", "format": "bf16"}).check_matches(sites)
    for rule in ({"modules": "linear_fc9", "format": "bf16"},       # a typo
                 {"layers": [5], "format": "bf16"},                 # a layer it lacks
                 {"modules": "core_attention", "roles": ["wgrad"], "format": "bf16"}):
        with pytest.raises(PlanError, match="rule 1 .* matches no GEMM of this model"):
            _plan(rule).check_matches(sites)


def test_unreadable_or_invalid_yaml_files_are_one_line(tmp_path):
    with pytest.raises(PlanError, match="cannot read the precision plan"):
        load_plan(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [\n")
    with pytest.raises(PlanError, match="not valid YAML"):
        load_plan(bad)


# ---- the readers --------------------------------------------------------------------------------
def _write(tmp_path, rules, default=None):
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(_plan(*rules, default=default)))
    return str(path)


def test_capture_config_reads_custom_quant_plan_beside_custom_quant_type(tmp_path):
    path = _write(tmp_path, [{"roles": ["dgrad", "wgrad"], "format": "bf16"}], "fp8_e4m3")
    cfg = load_config(env={"CUSTOM_QUANT_PLAN": path})
    assert cfg.quant_plan == path and cfg.quant_type == "fp8_e4m3" and cfg.emulating
    assert load_config(env={"CUSTOM_QUANT_PLAN": path,
                            "CUSTOM_QUANT_TYPE": "fp8_e4m3"}).quant_type == "fp8_e4m3"
    with pytest.raises(ConfigError, match="has default fp8_e4m3 but CUSTOM_QUANT_TYPE=mxfp4"):
        load_config(env={"CUSTOM_QUANT_PLAN": path, "CUSTOM_QUANT_TYPE": "mxfp4"})
    (tmp_path / "typo.yaml").write_text("rules: [{roles: [fprob], format: bf16}]\n")
    with pytest.raises(ConfigError, match="CUSTOM_QUANT_PLAN: .*fprob"):
        load_config(env={"CUSTOM_QUANT_PLAN": str(tmp_path / "typo.yaml")})


def test_emulation_takes_each_gemm_format_from_the_plan(tmp_path, monkeypatch):
    import torch

    path = _write(tmp_path, [{"modules": r"mlp\.", "roles": ["wgrad"], "format": "hp"},
                             {"layers": [1], "format": "bf16"}])
    plan = load_plan(path)
    monkeypatch.setattr(STATE, "quant_type", "fp8_e4m3")
    monkeypatch.setattr(STATE, "plan", plan)
    assert emulation.recipe_name(FC2_3, 3, "wgrad") is None           # hp: unquantized
    assert emulation.recipe_name(FC2_3, 3, "fprop") == "fp8_e4m3"
    assert emulation.recipe_name("decoder.layers.1.mlp.linear_fc1", 1, "fprop") == "bf16"
    x = torch.randn(8, 64) * 1e-3
    assert torch.equal(emulation.quantize_operand(x, "grad_output", "wgrad", site=FC2_3,
                                                  layer=3), x)
    import quant

    assert torch.equal(emulation.quantize_operand(x, "input", "forward", site=FC2_3, layer=3),
                       quant.quantize(x, "fp8_e4m3", axis=-1))
    # attention's Q·Kᵀ / P·V are its fprop role
    core1 = "decoder.layers.1.self_attention.core_attention"
    assert torch.equal(emulation.quantize(x, -1, site=core1, layer=1),
                       quant.quantize(x, "bf16", axis=-1))


def test_the_te_factory_gives_each_layout_the_format_of_the_gemm_it_feeds(tmp_path):
    plan = _plan({"modules": r"mlp\.linear_fc1$", "roles": ["wgrad"], "format": "hp"},
                 {"layers": [0], "roles": ["fprop"], "format": "bf16"})
    role = SimpleNamespace(module_type="linear", tensor_type="input",
                           name="model.decoder.layers.2.mlp.linear_fc1")   # layer_number 2
    # input: rowwise feeds fprop (layer 1 under the 1-based name: no rule), columnwise wgrad
    assert factory.slot_formats(role, factory.role_plan((), plan), "mxfp8") == ("mxfp8", "hp")
    grad = SimpleNamespace(module_type="linear", tensor_type="grad_output",
                           name="decoder.layers.0.mlp.linear_fc1")
    assert factory.slot_formats(grad, factory.role_plan((), plan), "mxfp8") == ("mxfp8", "hp")     # dgrad, wgrad
    weight = SimpleNamespace(module_type="linear", tensor_type="weight",
                             name="decoder.layers.0.self_attention.linear_qkv")
    assert factory.slot_formats(weight, factory.role_plan((), plan), "mxfp8") == ("bf16", "mxfp8")  # fprop, dgrad
    assert factory.slot_formats(SimpleNamespace(module_type="dpa", tensor_type="input"),
                                factory.role_plan((), plan), "mxfp8") == ("hp", "hp")
    # a plan's operands rule is the grad_output slot's alone: the weight's dgrad layout keeps
    # the default, where a whole-GEMM caller would give all of dgrad the rule's format
    ops = factory.role_plan((), _plan({"operands": ["grad_output"], "format": "hp"}))
    assert factory.slot_formats(grad, ops, "mxfp8") == ("hp", "hp")
    assert factory.slot_formats(weight, ops, "mxfp8") == ("mxfp8", "mxfp8")
    # LOWP_TE_ROLE_FORMATS rules come first, the plan decides what they leave
    ruled = factory.role_plan(factory.parse_rules("tensor_type=weight:nvfp4"), plan)
    assert factory.slot_formats(weight, ruled, "mxfp8") == ("nvfp4", "nvfp4")
    assert factory.slot_formats(grad, ruled, "mxfp8") == ("mxfp8", "hp")
    te_recipe = _plan({"format": "te_mxfp8"})
    with pytest.raises(factory.FactoryError, match="not a known format"):
        factory.slot_formats(role, factory.role_plan((), te_recipe), "mxfp8")


# ---- Megatron-LM's --te-precision-config-file -----------------------------------------------------
SITES = [PlanSite(f"decoder.layers.{i}.{s}", i) for i in range(2)
         for s in ("self_attention.linear_qkv", "mlp.linear_fc1")] + [PlanSite("output_layer",
                                                                                None)]


def test_megatron_config_has_one_glob_matcher_per_module_in_another_recipe():
    plan = _plan({"layers": [1], "format": "bf16"}, {"modules": "output", "format": "te_nvfp4"},
                 default="te_mxfp8")
    cfg = megatron_config.to_megatron(plan, SITES, "te_mxfp8")
    patterns = {m["pattern"]: cfg["configs"][m["config"]]["training_recipe"]
                for m in cfg["matchers"].values()}
    assert patterns == {"decoder.layers.1.self_attention.linear_qkv": {},
                        "decoder.layers.1.mlp.linear_fc1": {},
                        "output_layer": {"fp4_quantization_recipe": "nvfp4"}}
    assert all(m["type"] == "glob" and m["enabled"] is True for m in cfg["matchers"].values())
    assert all(c["transformer_engine_config_type"] == "TEQuantizationParams"
               for c in cfg["configs"].values())


def test_megatron_config_refuses_a_plan_that_selects_operands():
    plan = _plan({"modules": "linear_fc1", "operands": ["input", "weight"], "format": "te_mxfp8"})
    with pytest.raises(UserError) as err:
        megatron_config.to_megatron(plan, SITES, "bf16")
    line = str(err.value)
    assert line.startswith("decoder.layers.0.mlp.linear_fc1: the plan selects operands of its "
                           "fprop, dgrad, wgrad GEMM(s)") and "quantizer_factory" in line
    assert "\n" not in line
    # the same modules without operands: one recipe for the module, converted
    whole = _plan({"modules": "linear_fc1", "format": "te_mxfp8"})
    assert len(megatron_config.to_megatron(whole, SITES, "bf16")["matchers"]) == 2


def test_megatron_config_refuses_what_megatron_cannot_express():
    with pytest.raises(UserError, match="one recipe per module"):
        megatron_config.to_megatron(_plan({"roles": ["wgrad"], "format": "bf16"}), SITES,
                                    "te_mxfp8")
    with pytest.raises(UserError, match="mxfp4 has no Megatron-LM recipe"):
        megatron_config.to_megatron(_plan({"layers": [0], "format": "mxfp4"}), SITES, "bf16")
