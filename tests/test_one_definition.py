"""Format lists, metadata names and "is capture on?" each have one definition."""
from __future__ import annotations

import pytest

from quant.formats import (
    FORMATS,
    MX_OF_ELEMENT,
    SCALING_MX,
    SURVEY_FORMATS,
    UNDERSCORED_NAMES,
    format_for_dtype,
)


def test_format_lists_derive_from_the_table():
    import torch

    from quant import mxfp, scaling_sweep
    from tensor_capture import schema
    from tensor_viz.options import DEFAULT_WHATIF
    from training_profiler.tensor_analyzer import DEFAULT_FORMATS

    assert mxfp.MX_OF_ELEMENT is MX_OF_ELEMENT
    assert all(FORMATS[mx].scaling == SCALING_MX and FORMATS[mx].element == el
               for el, mx in MX_OF_ELEMENT.items())
    assert scaling_sweep.ELEMENT_FORMATS == tuple(MX_OF_ELEMENT)
    assert DEFAULT_WHATIF == DEFAULT_FORMATS == SURVEY_FORMATS
    assert set(SURVEY_FORMATS) <= set(FORMATS)
    assert set(schema._UNDERSCORED_QUANT_TYPES) == {n for n in FORMATS if "_" in n}
    assert [format_for_dtype(d) for d in (torch.bfloat16, torch.float16, torch.float32,
                                          torch.float64)] == ["bf16", "fp16", "fp32", None]


def test_old_names_split_on_the_longest_format_name():
    from tensor_capture import schema

    assert list(UNDERSCORED_NAMES) == sorted(UNDERSCORED_NAMES, key=len, reverse=True)
    for fmt in UNDERSCORED_NAMES:        # v2 layout: the quant type is free text before the name
        name = schema.parse_filename(f"20240101_000000_0001_linear_L1_forward_pre_linear_{fmt}_input.pt")
        assert (name.quant_type, name.tensor_name) == (fmt, "input")


def test_quantized_operand_names_and_variants_come_from_the_schema():
    from tensor_capture import schema
    from tensor_viz import pipeline

    for base in ("input", "grad_output", "weight", "query"):
        for wgrad in (False, True):
            q = schema.quantized_name(base, wgrad)
            assert q != base and schema.hp_twin_name(q) == base
    assert pipeline.hp_twin_name is schema.hp_twin_name
    assert pipeline.QUANTIZED_SUFFIXES is schema.QUANTIZED_SUFFIXES


@pytest.mark.parametrize("env, on", [
    ({}, False), ({"TENSOR_SAVE_ENABLED": "true"}, True), ({"TENSOR_SAVE_ENABLED": "0"}, False),
    ({"TENSOR_SAVE_ENABLED": "off"}, False), ({"TENSOR_SAVE_ENABLED": "ture"}, True),  # validated later
    ({"CUSTOM_QUANT_TYPE": "fp32"}, False), ({"CUSTOM_QUANT_TYPE": "mxfp8"}, True),
    ({"CUSTOM_QUANT_TYPE": "None"}, False), ({"TENSOR_SAVE_CONFIG": "capture.yaml"}, True),
])
def test_capture_on_is_read_from_the_environment_in_one_place(env, on):
    from tensor_capture import state
    from tensor_capture.config import env_requests_activity
    from training_driver.capture import capture_requested

    assert state.env_requests_activity is env_requests_activity
    assert env_requests_activity(env) is on and capture_requested(env) is on


def test_whatif_scalars_are_the_keys_every_whatif_record_has():
    """TensorBoard, the report's numerics table and TE's debug feature read one list; a number
    the record gains or loses must show in that list, or a consumer would silently miss it."""
    import torch

    from quant.whatif import whatif
    from quant.whatif_record import SCALAR_KEYS
    from tensor_capture import tensorboard
    from tensor_viz import numerics_data

    record = whatif(torch.randn(64, 64), "mxfp8")
    scalar_keys = {k for k, v in record.items() if isinstance(v, float) and k != "axis"}
    assert scalar_keys == set(SCALAR_KEYS)
    assert tensorboard.SCALARS is numerics_data.NUMBER_FIELDS is SCALAR_KEYS


def test_gemm_tables_and_high_precision_are_defined_once():
    """Issue 42 item 4: each of these tables is the one definition, imported where it is used."""
    from quant import analysis, gemm_plan, precision_plan, recipes, severity
    from quant.formats import HIGH_PRECISION, HIGH_PRECISION_NAMES
    from te_integration import factory, layouts
    from tensor_capture import emulation, schema, sites
    from tensor_viz.diagnose import rules as diagnose_rules
    from training_profiler import lowp_emulation

    assert precision_plan.ROLES is gemm_plan.LINEAR_GEMMS
    assert recipes.ROLES == tuple((p.operand, p.gemm) for p in gemm_plan.PLAN
                                  if p.gemm in gemm_plan.LINEAR_GEMMS)
    assert {g for _, g in recipes.ROLES} == set(gemm_plan.LINEAR_GEMMS)
    # the layout table: its GEMM names are the plan's; the factory reads it, and the emulated
    # GEMM's blocking axes follow it (test_te_integration.test_layouts_follow_the_gemm_plan)
    assert set(layouts.LAYOUT_GEMM.values()) == set(gemm_plan.LINEAR_GEMMS)
    assert factory.LAYOUT_GEMM is layouts.LAYOUT_GEMM
    assert precision_plan.HP == factory.HP == schema.VARIANT_HP == HIGH_PRECISION
    for word in HIGH_PRECISION_NAMES:
        assert precision_plan.check_format(word.upper(), "t") == HIGH_PRECISION
        assert factory._check_format(word.upper(), "t") == HIGH_PRECISION
        assert word in emulation._UNQUANTIZED
    assert lowp_emulation._MEGATRON_LINEARS is sites.LINEAR_CLASSES
    assert diagnose_rules.RATIO_LIMIT == analysis.HIGH_THRESHOLD == severity.HIGH_THRESHOLD
    assert analysis.severity is severity.severity
