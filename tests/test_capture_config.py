"""Capture settings: environment, YAML, precedence, and one clear error for each bad value."""
from __future__ import annotations

import pytest

from tensor_capture.config import ConfigError, load_config


def test_defaults_and_environment():
    c = load_config(env={})
    assert not c.enabled and c.quant_type is None and not c.emulating
    c = load_config(env={"TENSOR_SAVE_ENABLED": "true", "TENSOR_SAVE_DIR": "/x",
                         "TENSOR_SAVER_ITERATION": "7", "CUSTOM_QUANT_TYPE": "mxfp8"})
    assert c.enabled and c.save_dir == "/x" and c.iteration == 7 and c.emulating
    assert not load_config(env={"CUSTOM_QUANT_TYPE": "fp32"}).emulating


def test_yaml_file_with_nested_schedule_and_env_precedence(tmp_path):
    cfg = tmp_path / "cap.yaml"
    cfg.write_text("enabled: true\nsave_dir: /from/yaml\niterations: {start: 2, end: 9, every: 3}\n"
                   "layers: [0, 3]\nmodule_regex: 'mlp\\.linear_fc1$'\noperations: [forward]\n"
                   "phases: pre\nbyte_budget: 2MiB\nmax_rows: 16\nstats_only: false\n"
                   "ranks: [0]\nrange_formats: [fp8_e5m2]\n")
    c = load_config(env={"TENSOR_SAVE_CONFIG": str(cfg), "TENSOR_SAVE_DIR": "/from/env"})
    assert (c.iter_start, c.iter_end, c.iter_every) == (2, 9, 3)
    assert c.layers == (0, 3) and c.operations == ("forward",) and c.phases == ("pre",)
    assert c.byte_budget == 2 * 2 ** 20 and c.max_rows == 16 and c.ranks == (0,)
    assert c.save_dir == "/from/env"                       # environment beats the file
    assert load_config(cfg, env={}, save_dir="/kw").save_dir == "/kw"   # keywords beat both


@pytest.mark.parametrize("env, fragment", [
    ({"TENSOR_SAVE_ENABLED": "maybe"}, "TENSOR_SAVE_ENABLED='maybe' is not a boolean"),
    ({"TENSOR_SAVER_ITERATION": "x"}, "TENSOR_SAVER_ITERATION='x' must be an integer"),
    ({"TENSOR_SAVER_ITERATION": "-1"}, "TENSOR_SAVER_ITERATION=-1 must be >= 0"),
    ({"TENSOR_SAVE_DIR": "  "}, "TENSOR_SAVE_DIR"),
])
def test_bad_environment_values(env, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(env=env)
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg and msg.startswith("tensor capture:")


def test_unknown_quant_type_lists_the_valid_names():
    import quant

    with pytest.raises(ConfigError) as err:
        load_config(env={"CUSTOM_QUANT_TYPE": "mxfp9"})
    msg = str(err.value)
    assert "CUSTOM_QUANT_TYPE='mxfp9'" in msg
    assert all(name in msg for name in quant.FORMATS)


@pytest.mark.parametrize("text, fragment", [
    ("enabeld: true\n", "unknown capture setting(s) ['enabeld']"),
    ("operations: [sideways]\n", "operations=['sideways']: choose from"),
    ("iterations: {start: 5, end: 2}\n", "end=2 is before start=5"),
    ("iterations: {begin: 1}\n", "unknown key(s) ['begin'] under 'iterations'"),
    ("module_regex: '('\n", "module_regex='(' is not a regular expression"),
    ("byte_budget: lots\n", "byte_budget='lots' is not a size"),
    ("range_formats: [fp7]\n", "range_formats='fp7' is not a known format"),
    ("- a\n- b\n", "must be a mapping"),
    ("a: [1\n", "not valid YAML"),
])
def test_bad_yaml_values_name_the_file_and_setting(tmp_path, text, fragment):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(cfg, env={})
    assert fragment in str(err.value) and str(cfg) in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the capture config"):
        load_config(tmp_path / "nope.yaml", env={})
