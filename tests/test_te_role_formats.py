"""Which format the TE quantizer factory gives each layout of each linear operand slot, under
LOWP_TE_ROLE_FORMATS rules, a precision plan, both and neither: a table recorded from the factory
before its rules became precision-plan rules (issue 49), so the one decision path is held to
every choice the two paths made. Transformer Engine does not import here: the stand-in
EmulatedQuantizer records the (rowwise, columnwise) formats the factory hands it."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from quant.precision_plan import plan_from_dict
from te_integration import factory

RULES = {
    "none": "",
    "operand_and_suffix": ("tensor_type=grad_output:fp8_e5m2_tensor;"
                           "name=linear_fc2,tensor_type=weight:nvfp4"),
    "regex": r"name~=layers\.(0|1)\.self_attention:hp",
    "layer_suffix": "name=layers.1.mlp.linear_fc2,tensor_type=weight:hp;name~=linear_fc1$:mxfp4",
    "linear_only": "module_type=linear,tensor_type=input:bf16",
}
PLANS = {
    "none": None,
    "plan": {"rules": [{"modules": r"mlp\.linear_fc1$", "roles": ["wgrad"], "format": "hp"},
                       {"layers": [0], "roles": ["fprop"], "format": "bf16"}]},
    "plan_default": {"rules": [{"modules": "linear_qkv", "roles": ["dgrad"], "format": "mxfp4"}],
                     "default": "nvfp4"},
}
#: the layer names TE may hand the factory: module paths, an nvdlfw-inspect name, a bare name,
#: TE's placeholder and none
NAMES = ("decoder.layers.0.self_attention.linear_qkv", "decoder.layers.1.mlp.linear_fc1",
         "decoder.layers.1.mlp.linear_fc2", "decoder.layers.11.self_attention.linear_qkv",
         "decoder.layers.2.mlp.linear_fc2", "model.decoder.layers.1.self_attention.linear_qkv",
         "output_layer", "fc2", "Layer_3", "")
#: (rules, plan, tensor_type) -> per name of NAMES: "fmt" (both layouts), "rowwise/columnwise",
#: or "refused" (FactoryError); CUSTOM_QUANT_TYPE is mxfp8
BEFORE = {
    ('none', 'none', 'input'): 'mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8',
    ('none', 'none', 'weight'): 'mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8',
    ('none', 'none', 'grad_output'): 'mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8',
    ('none', 'plan', 'input'): 'bf16/mxfp8 mxfp8/hp mxfp8 mxfp8 mxfp8 bf16/mxfp8 mxfp8 mxfp8 mxfp8 mxfp8',
    ('none', 'plan', 'weight'): 'bf16/mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 bf16/mxfp8 mxfp8 mxfp8 mxfp8 mxfp8',
    ('none', 'plan', 'grad_output'): 'mxfp8 mxfp8/hp mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8',
    ('none', 'plan_default', 'input'): 'nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 nvfp4',
    ('none', 'plan_default', 'weight'): 'nvfp4/mxfp4 nvfp4 nvfp4 nvfp4/mxfp4 nvfp4 nvfp4/mxfp4 nvfp4 nvfp4 nvfp4 nvfp4',
    ('none', 'plan_default', 'grad_output'): 'mxfp4/nvfp4 nvfp4 nvfp4 mxfp4/nvfp4 nvfp4 mxfp4/nvfp4 nvfp4 nvfp4 nvfp4 nvfp4',
    ('operand_and_suffix', 'none', 'input'): 'mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 refused refused',
    ('operand_and_suffix', 'none', 'weight'): 'mxfp8 mxfp8 nvfp4 mxfp8 nvfp4 mxfp8 mxfp8 mxfp8 refused refused',
    ('operand_and_suffix', 'none', 'grad_output'): 'fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor refused refused',
    ('operand_and_suffix', 'plan', 'input'): 'bf16/mxfp8 mxfp8/hp mxfp8 mxfp8 mxfp8 bf16/mxfp8 mxfp8 mxfp8 refused refused',
    ('operand_and_suffix', 'plan', 'weight'): 'bf16/mxfp8 mxfp8 nvfp4 mxfp8 nvfp4 bf16/mxfp8 mxfp8 mxfp8 refused refused',
    ('operand_and_suffix', 'plan', 'grad_output'): 'fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor refused refused',
    ('operand_and_suffix', 'plan_default', 'input'): 'nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 refused refused',
    ('operand_and_suffix', 'plan_default', 'weight'): 'nvfp4/mxfp4 nvfp4 nvfp4 nvfp4/mxfp4 nvfp4 nvfp4/mxfp4 nvfp4 nvfp4 refused refused',
    ('operand_and_suffix', 'plan_default', 'grad_output'): 'fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor fp8_e5m2_tensor refused refused',
    ('regex', 'none', 'input'): 'hp mxfp8 mxfp8 mxfp8 mxfp8 hp mxfp8 mxfp8 refused refused',
    ('regex', 'none', 'weight'): 'hp mxfp8 mxfp8 mxfp8 mxfp8 hp mxfp8 mxfp8 refused refused',
    ('regex', 'none', 'grad_output'): 'hp mxfp8 mxfp8 mxfp8 mxfp8 hp mxfp8 mxfp8 refused refused',
    ('regex', 'plan', 'input'): 'hp mxfp8/hp mxfp8 mxfp8 mxfp8 hp mxfp8 mxfp8 refused refused',
    ('regex', 'plan', 'weight'): 'hp mxfp8 mxfp8 mxfp8 mxfp8 hp mxfp8 mxfp8 refused refused',
    ('regex', 'plan', 'grad_output'): 'hp mxfp8/hp mxfp8 mxfp8 mxfp8 hp mxfp8 mxfp8 refused refused',
    ('regex', 'plan_default', 'input'): 'hp nvfp4 nvfp4 nvfp4 nvfp4 hp nvfp4 nvfp4 refused refused',
    ('regex', 'plan_default', 'weight'): 'hp nvfp4 nvfp4 nvfp4/mxfp4 nvfp4 hp nvfp4 nvfp4 refused refused',
    ('regex', 'plan_default', 'grad_output'): 'hp nvfp4 nvfp4 mxfp4/nvfp4 nvfp4 hp nvfp4 nvfp4 refused refused',
    ('layer_suffix', 'none', 'input'): 'mxfp8 mxfp4 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 refused refused',
    ('layer_suffix', 'none', 'weight'): 'mxfp8 mxfp4 hp mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 refused refused',
    ('layer_suffix', 'none', 'grad_output'): 'mxfp8 mxfp4 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 refused refused',
    ('layer_suffix', 'plan', 'input'): 'bf16/mxfp8 mxfp4 mxfp8 mxfp8 mxfp8 bf16/mxfp8 mxfp8 mxfp8 refused refused',
    ('layer_suffix', 'plan', 'weight'): 'bf16/mxfp8 mxfp4 hp mxfp8 mxfp8 bf16/mxfp8 mxfp8 mxfp8 refused refused',
    ('layer_suffix', 'plan', 'grad_output'): 'mxfp8 mxfp4 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 refused refused',
    ('layer_suffix', 'plan_default', 'input'): 'nvfp4 mxfp4 nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 nvfp4 refused refused',
    ('layer_suffix', 'plan_default', 'weight'): 'nvfp4/mxfp4 mxfp4 hp nvfp4/mxfp4 nvfp4 nvfp4/mxfp4 nvfp4 nvfp4 refused refused',
    ('layer_suffix', 'plan_default', 'grad_output'): 'mxfp4/nvfp4 mxfp4 nvfp4 mxfp4/nvfp4 nvfp4 mxfp4/nvfp4 nvfp4 nvfp4 refused refused',
    ('linear_only', 'none', 'input'): 'bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16',
    ('linear_only', 'none', 'weight'): 'mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8',
    ('linear_only', 'none', 'grad_output'): 'mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8',
    ('linear_only', 'plan', 'input'): 'bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16',
    ('linear_only', 'plan', 'weight'): 'bf16/mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 bf16/mxfp8 mxfp8 mxfp8 mxfp8 mxfp8',
    ('linear_only', 'plan', 'grad_output'): 'mxfp8 mxfp8/hp mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8 mxfp8',
    ('linear_only', 'plan_default', 'input'): 'bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16',
    ('linear_only', 'plan_default', 'weight'): 'nvfp4/mxfp4 nvfp4 nvfp4 nvfp4/mxfp4 nvfp4 nvfp4/mxfp4 nvfp4 nvfp4 nvfp4 nvfp4',
    ('linear_only', 'plan_default', 'grad_output'): 'mxfp4/nvfp4 nvfp4 nvfp4 mxfp4/nvfp4 nvfp4 mxfp4/nvfp4 nvfp4 nvfp4 nvfp4 nvfp4',
}


def _stand_in(fmt, tensor_type="", fmt_columnwise=None):
    return (fmt, fmt_columnwise or fmt)


@pytest.mark.parametrize("rules,plan", list(itertools.product(RULES, PLANS)))
def test_the_factory_chooses_what_it_chose_before_rules_became_plan_rules(monkeypatch, rules,
                                                                         plan):
    monkeypatch.setattr(factory, "_te_quantizer_module",
                        lambda: SimpleNamespace(EmulatedQuantizer=_stand_in))
    raw = PLANS[plan]
    qfactory = factory.make_factory("mxfp8", factory.parse_rules(RULES[rules]),
                                    plan_from_dict(raw, "plan.yaml") if raw else None)
    for tensor in ("input", "weight", "grad_output"):
        got = []
        for name in NAMES:
            try:
                row, col = qfactory(SimpleNamespace(module_type="linear", tensor_type=tensor,
                                                    name=name))
                got.append(row if row == col else f"{row}/{col}")
            except factory.FactoryError:
                got.append("refused")
        assert dict(zip(NAMES, got)) == dict(zip(NAMES, BEFORE[(rules, plan, tensor)].split())), (
            rules, plan, tensor)
    assert qfactory(None) == ("hp", "hp")
