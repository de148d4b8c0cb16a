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
    from quant.vocabulary import HIGH_PRECISION, HIGH_PRECISION_NAMES
    from te_integration import emulated_gemm, factory, layouts
    from tensor_capture import schema, sites
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
    assert schema.VARIANT_HP == HIGH_PRECISION
    for word in HIGH_PRECISION_NAMES:
        assert precision_plan.check_format(word.upper(), "t") == HIGH_PRECISION
        assert factory._check_format(word.upper(), "t") == HIGH_PRECISION
    # the TE layouts' blocking axes derive from the layout table and the plan (no twin table)
    assert emulated_gemm.AXIS_OF_USAGE == {
        lay: gemm_plan.axis(gemm, operand) for (operand, lay), gemm in layouts.LAYOUT_GEMM.items()}
    assert lowp_emulation._MEGATRON_LINEARS is sites.LINEAR_CLASSES
    assert diagnose_rules.RATIO_LIMIT == analysis.HIGH_THRESHOLD == severity.HIGH_THRESHOLD
    assert analysis.severity is severity.severity


# -- the vocabulary (issue 49 item 2): quant.vocabulary defines each word list once ---------------

def _library_trees():
    """(path, AST) of every library module but the vocabulary itself."""
    import ast

    from test_architecture import REPO, _library_files

    for path in _library_files():
        rel = path.relative_to(REPO).as_posix()
        if rel != "quant/vocabulary.py" and rel.split("/")[0] not in ("script", "examples"):
            yield rel, ast.parse(path.read_text(encoding="utf-8"))


def _respelled(words: tuple[str, ...], fold=str) -> list[str]:
    """Tuple / list / set literals in the library that spell two or more of ``words`` (a second
    definition of that list); ``fold`` maps a literal before the comparison."""
    import ast

    found = []
    for rel, tree in _library_trees():
        exports = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in exports:
                hits = {fold(e.value) for e in node.elts
                        if isinstance(e, ast.Constant) and isinstance(e.value, str)} & set(words)
                if len(hits) >= 2:
                    found.append(f"{rel}:{node.lineno} {sorted(hits)}")
    return found


def _vocabulary_lists():
    from quant import vocabulary as v
    from tensor_capture import schema

    return {"high-precision names": (v.HIGH_PRECISION_NAMES, str.lower),
            "low-precision dtypes": (v.LOW_PRECISION_DTYPES, str),
            "linear GEMM names": (v.LINEAR_GEMMS, str),
            "linear operand names": (v.LINEAR_OPERANDS, str),
            "severity labels": (tuple(s.label for s in v.Severity), str.upper),
            "on / off words": (v.TRUE_WORDS + v.FALSE_WORDS, str.lower),
            # capture's own words (tensor_capture.schema: a record's phase and layer_type)
            "capture phases": (schema.PHASES, str),
            "capture layer types": (schema.LAYER_TYPES, str)}


@pytest.mark.parametrize("item", ["high-precision names", "low-precision dtypes",
                                  "linear GEMM names", "linear operand names", "severity labels",
                                  "on / off words", "capture phases", "capture layer types"])
def test_each_word_list_is_spelled_once(item):
    """A second spelling of the list (a tuple of two of its words) anywhere in the library fails;
    use quant.vocabulary's name (or a table derived from it) instead."""
    words, fold = _vocabulary_lists()[item]
    defining = "tensor_capture/schema.py" if item.startswith("capture") else None
    found = [f for f in _respelled(words, fold) if not f.startswith(f"{defining}:")]
    assert found == [], f"{item} re-spelled; import the one definition"


def test_the_respelling_check_can_fail(tmp_path, monkeypatch):
    """The scan above sees a re-spelled list (so an empty result means something)."""
    import ast

    import test_one_definition as me

    tree = ast.parse('LOWP = ("float16", "bfloat16")\nSEV = {"HIGH": 0, "LOW": 2}\nX = ["hp", "FP32"]\n')
    monkeypatch.setattr(me, "_library_trees", lambda: [("fake.py", tree)])
    lists = _vocabulary_lists()
    assert _respelled(*lists["low-precision dtypes"]) == ["fake.py:1 ['bfloat16', 'float16']"]
    assert _respelled(*lists["high-precision names"]) == ["fake.py:3 ['fp32', 'hp']"]
    assert _respelled(*lists["severity labels"]) == []      # dict keys are a table, not a list


def test_environment_variable_names_are_written_once():
    """Every capture / emulation variable is a constant of quant.vocabulary: a library module
    that writes the name as a string (``os.environ.get("TENSOR_SAVE_DIR")``) fails."""
    import ast

    from quant import vocabulary

    names = {v for k, v in vars(vocabulary).items() if k.startswith("ENV_")}
    assert {"CUSTOM_QUANT_TYPE", "TENSOR_SAVE_DIR", "TENSOR_SAVER_ITERATION"} <= names
    found = [f"{rel}:{node.lineno} {node.value}" for rel, tree in _library_trees()
             for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in names]
    assert found == [], "use quant.vocabulary's ENV_* constants"


def test_every_format_name_reader_makes_the_one_check():
    """Capture's CUSTOM_QUANT_TYPE and range formats, the precision plan, the TE factory and the
    TE debug features' YAML take a format name through quant.vocabulary.check_format_name: one
    message, the same case folding, "hp" wherever a quantization is chosen."""
    from quant import precision_plan
    from quant.vocabulary import HIGH_PRECISION, check_format_name
    from te_integration import factory, options
    from tensor_capture.config import ConfigError, load_config

    readers = {
        "CUSTOM_QUANT_TYPE": lambda n: load_config(env={"CUSTOM_QUANT_TYPE": n}).quant_type,
        "range_formats": lambda n: load_config(env={}, range_formats=[n]).range_formats[0],
        "plan": lambda n: precision_plan.plan_from_dict({"default": n}, "p.yaml").default,
        "factory": lambda n: factory._check_format(n, "factory"),
        "te yaml": lambda n: options.FEATURE_OPTIONS["LowpWhatIf"]["formats"]("formats", [n])[0],
    }
    errors = (ConfigError, precision_plan.PlanError, factory.FactoryError, options.InspectConfigError)
    for where, read in readers.items():
        assert read(" MXFP8 ") == "mxfp8", where
        with pytest.raises(errors) as exc:
            read("fp9")
        assert "='fp9' is not a known format; valid: " in str(exc.value), where
    for where in ("CUSTOM_QUANT_TYPE", "plan", "factory"):       # a quantization is chosen
        assert readers[where]("HP") in ("hp", HIGH_PRECISION), where
    assert check_format_name("HP", "x") == HIGH_PRECISION
