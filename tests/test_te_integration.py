"""Our numerics in Transformer Engine's debug API and our formats inside TE linears.

The debug features run through ``nvdlfw_inspect.api.initialize(config_file=..., feature_dirs=
[our folder, the TE-namespace stand-in])`` and a TE 2.20 linear's calls
(tests/te_helpers.py); their logged numbers are re-derived here with quant.quantize and plain
torch. The factory's numerics (emulated_gemm) are checked against quant.gemm_plan's emulation;
its TE glue runs only where Transformer Engine imports (skipped here, saying so).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from error_bounds import ratio_of_sums_bound, sqnr_db_bound

pytest.importorskip("nvdlfw_inspect", reason="nvdlfw-inspect (the te extra) is not installed")

import nvdlfw_inspect.api as debug_api
from te_helpers import ROOT, initialize, make_logger, te_linear_calls

import quant
from quant import gemm_plan
from quant.precision_plan import plan_from_dict
from quant.vocabulary import LINEAR_OPERANDS
from te_integration import emulated_gemm, factory, names, options
from te_integration.layouts import LAYOUT_GEMM

FC1 = "model.decoder.layers.2.mlp.linear_fc1"     # layer_number 2: our layer index 1


@pytest.fixture(autouse=True)
def _clean_debug_api():
    debug_api.end_debug()
    yield
    debug_api.end_debug()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inspect.yaml"
    path.write_text(text)
    return path


def _operand(shape, seed) -> torch.Tensor:
    """Values over ~20 binades with exact zeros and outliers: blocks that clip and flush."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 8, shape, generator=g).float())
    x[torch.rand(shape, generator=g) < 0.05] = 0.0
    return x


def _sqnr(x: torch.Tensor, q: torch.Tensor) -> float:
    x, q = x.double(), q.double()
    return 10 * math.log10(float((x * x).sum()) / float(((x - q) ** 2).sum()))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Blocks of ``block`` consecutive elements along the last axis (zero padded)."""
    pad = (-x.shape[-1]) % block
    return torch.nn.functional.pad(x, (0, pad)).reshape(-1, block)


YAML = """
fc1_numerics:
  enabled: True
  layers:
    layer_name_regex_pattern: .*linear_fc1$
  transformer_engine:
    LowpWhatIf:
      enabled: True
      tensors: [activation, weight, gradient]
      formats: [mxfp8, nvfp4, hifp8, fp8_e4m3_tensor]
    LowpBlockScaleStats:
      enabled: True
      tensors_struct:
        - tensor: activation
          formats: [mxfp8, nvfp4]
        - tensor: gradient
          formats: [mxfp4]
          freq: 2
"""


def test_whatif_and_block_scale_statistics_are_logged_and_rederived(tmp_path):
    logger = make_logger()
    initialize(_write(tmp_path, YAML), tmp_path / "logs", logger)
    x, w, g = _operand((24, 96), 1), _operand((40, 96), 2), _operand((24, 40), 3)
    answers = te_linear_calls(FC1, {"activation": x, "weight": w, "gradient": g}, iteration=0)
    assert answers == {"activation": (True, 1), "weight": (True, 1), "gradient": (True, 1)}
    # a layer the YAML does not select gets nothing
    assert te_linear_calls("model.decoder.layers.2.mlp.linear_fc2", {"activation": x}, 0) == {
        "activation": (False, None)}
    v = {name: value for (name, it), value in logger.values.items() if it == 0}
    assert not any("linear_fc2" in name for name in v)

    # what-if SQNR / relative error / flush ratio, re-derived: quantize along the GEMM axis
    # (every operand here is blocked along its last axis: fprop input / weight, dgrad grad)
    for tname, t in (("activation", x), ("weight", w), ("gradient", g)):
        for fmt in ("mxfp8", "nvfp4", "hifp8", "fp8_e4m3_tensor"):
            q = quant.quantize(t, fmt, axis=-1)
            key = f"{FC1}_{tname}_{fmt}_"
            assert v[key + "sqnr_db"] == pytest.approx(_sqnr(t, q), abs=sqnr_db_bound(t.numel()))
            rel = float((t.double() - q.double()).abs().sum() / t.double().abs().sum())
            assert v[key + "rel_error"] == pytest.approx(rel, rel=ratio_of_sums_bound(t.numel()))
            flushed = int(((t != 0) & (q == 0)).sum())
            assert v[key + "flush_ratio"] == flushed / t.numel()
    # FP4 loses more than FP8: the numbers are not all the same
    assert v[f"{FC1}_activation_nvfp4_sqnr_db"] < v[f"{FC1}_activation_mxfp8_sqnr_db"]

    # MX block scales: E8M0 exponent floor(log2 amax) - 8 (E4M3's emax) per block of 32
    amax = _blocks(x, 32).abs().amax(dim=-1)
    live = amax[amax > 0]
    exps = [math.frexp(float(a))[1] - 1 - 8 for a in live]
    key = f"{FC1}_activation_mxfp8_"
    assert v[key + "scale_min"] == min(exps) and v[key + "scale_max"] == max(exps)
    assert v[key + "scale_std"] == pytest.approx(torch.tensor(exps, dtype=torch.float64).std(
        unbiased=False).item())
    assert v[key + "blocks"] == amax.numel()
    assert {e: v[key + f"scale_hist_{e}"] for e in set(exps)} == dict(Counter(exps))
    # blocks that flush: a nonzero element quantized to zero
    q = quant.quantize(x, "mxfp8", axis=-1)
    flush_blocks = int((((_blocks(x, 32) != 0) & (_blocks(q, 32) == 0)).sum(-1) > 0).sum())
    assert v[key + "flushed_block_ratio"] == flush_blocks / amax.numel()
    assert flush_blocks > 0
    clip = quant.analyze_quantization(x, "mxfp8", axis=-1).per_block["overflow"]
    assert v[key + "clipped_block_ratio"] == int((clip > 0).sum()) / clip.numel()

    # NVFP4 block scales: E4M3 cast of block amax / 6 / (tensor amax / (6 * 448))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    s_t = float(x.abs().max()) / (6 * 448)
    b16 = _blocks(x, 16).abs().amax(dim=-1)
    raw = np.clip(b16[b16 > 0].double().numpy() / 6 / s_t, 2.0 ** -9, 448)
    scales = raw.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    key = f"{FC1}_activation_nvfp4_"
    assert v[key + "scale_min"] == scales.min() and v[key + "scale_max"] == scales.max()
    assert v[key + "blocks"] == b16.numel()

    # the per-tensor struct: gradient block stats only for mxfp4, and every 2nd iteration
    assert f"{FC1}_gradient_mxfp4_scale_min" in v and f"{FC1}_gradient_mxfp8_scale_min" not in v
    assert f"{FC1}_weight_mxfp8_scale_min" not in v            # weight: what-if only
    debug_api.step()
    te_linear_calls(FC1, {"gradient": g}, iteration=1)
    assert not any(it == 1 and "gradient_mxfp4_scale" in n for (n, it) in logger.values)
    assert any(it == 1 and n == f"{FC1}_gradient_mxfp8_sqnr_db" for (n, it) in logger.values)


def test_schedule_answers_next_iteration(tmp_path):
    initialize(_write(tmp_path, """
s:
  enabled: True
  layers: {layer_name_regex_pattern: .*}
  transformer_engine:
    LowpWhatIf: {enabled: True, tensors: [activation], freq: 5, start_step: 3, end_step: 12}
"""), tmp_path / "logs", make_logger())
    got = [debug_api.transformer_engine.inspect_tensor_enabled(
        layer_name=FC1, tensor_name="activation", iteration=it) for it in (0, 5, 6, 10, 11)]
    assert got == [(False, 5), (True, 10), (False, 10), (True, None), (False, None)]


def test_capture_feature_writes_files_our_report_reads(tmp_path):
    from tensor_capture import schema
    from tensor_viz import catalog, numerics_csv

    caps = tmp_path / "tensors"
    initialize(_write(tmp_path, f"""
cap:
  enabled: True
  layers: {{layer_name_regex_pattern: .*linear_fc1$}}
  transformer_engine:
    LowpCapture:
      enabled: True
      tensors: [activation, gradient, output]
      save_dir: {caps}
      whatif_formats: [mxfp8, nvfp4]
"""), tmp_path / "logs", make_logger())
    x, g, y = _operand((24, 96), 4), _operand((24, 40), 5), _operand((24, 40), 6)
    te_linear_calls(FC1, {"activation": x, "gradient": g, "output": y}, iteration=0)
    debug_api.step()
    te_linear_calls(FC1, {"activation": x * 2}, iteration=1)
    debug_api.end_debug()                       # closes the saver: everything on disk

    recs = list(schema.read_manifest(caps))
    got = sorted((r["iteration"], r["operation"], r["phase"], r["tensor_name"]) for r in recs)
    assert got == [(0, "backward", "pre", "grad_output"), (0, "forward", "post", "output"),
                   (0, "forward", "pre", "input"), (1, "forward", "pre", "input")]
    for r in recs:
        assert r["layer_type"] == "linear" and r["layer_idx"] == 1 and r["module_path"] == FC1
        assert r["submodule"] == "linear_fc1" and r["debug_api"]["namespace"] == "transformer_engine"
        parsed = schema.parse_filename(r["file"]).to_dict()
        assert {k: r[k] for k in parsed} == parsed
    first = next(r for r in recs if r["iteration"] == 0 and r["tensor_name"] == "input")
    t, meta = schema.load_tensor_file(caps / first["file"])
    assert torch.equal(t, x)
    wi = meta[schema.META_WHATIF]
    assert wi[schema.WHATIF_AXIS] == -1 and wi[schema.WHATIF_AXIS_SOURCE] == schema.AXIS_FROM_GEMM
    assert wi["formats"]["mxfp8"]["sqnr_db"] == pytest.approx(
        _sqnr(x, quant.quantize(x, "mxfp8", axis=-1)), abs=sqnr_db_bound(x.numel()))
    out_rec = next(r for r in recs if r["tensor_name"] == "output")
    assert out_rec[schema.META_WHATIF][schema.WHATIF_AXIS_SOURCE] == schema.AXIS_LAST

    cat = catalog.scan(caps)                    # our report's reader
    assert not cat.problems and len(cat.entries) == 4
    assert {e.label for e in cat.entries} == {"L1 linear_fc1 forward input",
                                              "L1 linear_fc1 backward grad_output",
                                              "L1 linear_fc1 forward output"}
    rows = numerics_csv.rows(cat.entries)
    assert {r["format"] for r in rows} >= {"mxfp8", "nvfp4"}


@pytest.mark.parametrize("snippet,message", [
    ("LowpWhatIf: {enabled: True, tensors: [activation], formats: [mxfp8, mxfp9]}",
     "fc.transformer_engine.LowpWhatIf.formats='mxfp9' is not a known format; valid: fp8_e4m3"),
    ("LowpBlockScaleStats: {enabled: True, tensors: [activation], formats: [hifp8]}",
     "LowpBlockScaleStats.formats='hifp8' is not a known format; valid: mxfp8, mxfp8_e5m2"),
    ("LowpWhatIf: {enabled: True, tensors: [activation], frequency: 3}",
     "LowpWhatIf.frequency: unknown option 'frequency'; valid: enabled, end_step, formats, freq"),
    ("LowpCapture: {enabled: True, tensors: [query]}",
     "LowpCapture.tensors: unknown tensor 'query' for namespace transformer_engine; valid: "
     "activation, weight, gradient, output, dgrad, wgrad"),
    ("LowpWhatIf: {enabled: True, tensors_struct: [{tensor: weight, freq: 0}]}",
     "tensors_struct[0].freq: 0 must be an integer >= 1"),
], ids=["format", "block-format", "option", "tensor", "struct-option"])
def test_yaml_mistakes_fail_at_initialize_naming_key_and_valid_values(tmp_path, snippet, message):
    path = _write(tmp_path, "fc:\n  enabled: True\n  layers: {layer_name_regex_pattern: .*}\n"
                            f"  transformer_engine:\n    {snippet}\n")
    with pytest.raises(options.InspectConfigError) as err:
        initialize(path, tmp_path / "logs")
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    assert len(str(err.value).splitlines()) == 1
    assert debug_api.DEBUG_MANAGER is None      # left uninitialised: a fixed YAML loads
    initialize(_write(tmp_path, YAML), tmp_path / "logs")


def test_unknown_feature_in_our_namespace_fails_at_initialize(tmp_path):
    path = _write(tmp_path, "a:\n  enabled: True\n  layers: {layer_name_regex_pattern: .*}\n"
                            "  lowp:\n    LowpWhatif: {enabled: True, tensors: [query]}\n")
    with pytest.raises(Exception) as err:      # nvdlfw-inspect's own check comes first
        initialize(path, tmp_path / "logs")
    assert "LowpWhatif" in str(err.value)
    import yaml

    with pytest.raises(options.InspectConfigError, match=r"a\.lowp: unknown feature 'LowpWhatif'; "
                       r"valid: LowpWhatIf, LowpBlockScaleStats, LowpCapture"):
        options.validate(yaml.safe_load(path.read_text()), str(path))   # lowp-te-check's check


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([env.pop("PREPEND", ""), str(ROOT)]), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=120)


def test_check_command_validates_and_names_the_folders(tmp_path):
    good = _write(tmp_path, YAML)
    out = _python("from te_integration.check_cli import main; raise SystemExit(main())"
                  .replace("main()", f"main([{str(good)!r}])"))
    assert out.returncode == 0, out.stderr
    assert "ok (1 section(s))" in out.stdout and "te_integration/debug_features" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(YAML.replace("hifp8, fp8_e4m3_tensor", "hifp9"))
    out = _python(f"from te_integration.check_cli import main; raise SystemExit(main([{str(bad)!r}]))")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "='hifp9' is not a known format" in out.stderr and "Traceback" not in out.stderr


def test_missing_nvdlfw_inspect_is_one_line_naming_the_extra(tmp_path):
    """A stand-in nvdlfw_inspect that fails to import, first on the path (as if absent)."""
    shim = tmp_path / "shim" / "nvdlfw_inspect"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('stand-in: not installed')\n")
    out = _python(f"from te_integration.check_cli import main; raise SystemExit(main([{str(tmp_path)!r}]))",
                  PREPEND=str(shim.parent))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "pip install 'megatron-lowp-tools[te]'" in out.stderr
    out = _python("import te_integration.features", PREPEND=str(shim.parent))
    assert out.returncode != 0 and "megatron-lowp-tools[te]" in out.stderr.strip().splitlines()[-1]


# -- the quantizer factory ---------------------------------------------------------------------
class Role:
    """QuantizerRole's fields (TE's frozen dataclass; TE does not import here)."""

    def __init__(self, module_type="", tensor_type="", name=""):
        self.module_type, self.tensor_type, self.name = module_type, tensor_type, name


def _chosen(role, rules=(), plan=None, default="mxfp8"):
    """The format the factory gives a slot whose two layouts agree (the rules give both one)."""
    row, col = factory.slot_formats(role, factory.role_plan(rules, plan), default)
    assert row == col, (row, col)
    return row


def test_factory_chooses_formats_per_role():
    rules = factory.parse_rules("tensor_type=grad_output:fp8_e5m2_tensor; "
                                "name=fc2,tensor_type=weight:nvfp4; module_type=linear:mxfp4")
    choose = lambda *a: _chosen(Role(*a), rules)  # noqa: E731
    assert choose("linear", "input", "fc1") == "mxfp4"                  # rule 3
    assert choose("grouped_linear", "weight", "experts") == "hp"         # refused: check_role
    assert choose("linear", "grad_output", "fc1") == "fp8_e5m2_tensor"   # first rule
    assert choose("linear", "weight", "fc2") == "nvfp4"
    assert choose("dpa", "qkv", "core_attention") == "hp"                # not a linear operand
    assert choose("linear", "output", "fc2") == "hp"
    assert _chosen(Role("linear", "input")) == "mxfp8"                   # no rule: the default
    assert _chosen(None, rules) == "hp"
    # Megatron's names: a full module path matches a name rule by dotted suffix, or by ~= regex
    assert choose("linear", "weight", "decoder.layers.1.mlp.fc2") == "nvfp4"
    assert choose("linear", "weight", "decoder.layers.1.mlp.linear_fc2") == "mxfp4"   # not "fc2"
    regex = factory.parse_rules(r"name~=layers\.(0|1)\.self_attention:hp")
    assert _chosen(Role("linear", "input", "model.decoder.layers.1.self_attention."
                                           "linear_qkv"), regex) == "hp"
    assert _chosen(Role("linear", "input", "decoder.layers.11.self_attention."
                                           "linear_qkv"), regex) == "mxfp8"
    # several name conditions in one rule: all must match
    both = factory.parse_rules(r"name~=layers\.1\.,name=linear_fc2:hp")
    assert _chosen(Role("linear", "input", "decoder.layers.1.mlp.linear_fc2"), both) == "hp"
    assert _chosen(Role("linear", "input", "decoder.layers.2.mlp.linear_fc2"), both) == "mxfp8"
    assert _chosen(Role("linear", "input", "decoder.layers.1.mlp.linear_fc1"), both) == "mxfp8"


def test_role_rules_and_plan_rules_name_layers_alike():
    """A rule matches the module path a plan matches: an nvdlfw-inspect name numbers layers
    from 1 (``model.decoder.layers.2`` is layer 1), so a name rule for layers.1 matches it as
    the plan rule for layer 1 does, and a suffix still matches whole components only."""
    rule = factory.parse_rules("name=layers.1.mlp.linear_fc2:hp")
    plan = factory.role_plan((), plan_from_dict({"rules": [
        {"modules": r"mlp\.linear_fc2$", "layers": [1], "format": "hp"}]}, "plan.yaml"))
    for name, fmt in (("model.decoder.layers.2.mlp.linear_fc2", "hp"),
                      ("model.decoder.layers.3.mlp.linear_fc2", "mxfp8"),
                      ("decoder.layers.11.mlp.linear_fc2", "mxfp8")):
        assert _chosen(Role("linear", "weight", name), rule) == fmt, name
        assert factory.slot_formats(Role("linear", "weight", name), plan, "mxfp8") == (fmt, fmt)


def test_factory_refuses_what_it_cannot_emulate_in_one_line():
    """Grouped linear (TE's grouped GEMM takes only TE's own tensors), and name rules when TE
    has no layer names (none, or TE's Layer_N placeholder): each one line naming the way out."""
    named = factory.parse_rules("name=linear_fc2:hp")
    for role, rules, words in ((Role("grouped_linear", "input", "experts"), (), "--moe-grouped-gemm"),
                               (Role("linear", "input", ""), named, "te_integration.megatron_lm"),
                               (Role("linear", "input", "Layer_7"), named, "selects layers by name")):
        with pytest.raises(factory.FactoryError) as err:
            factory.check_role(role, rules)
        assert words in str(err.value) and len(str(err.value).splitlines()) == 1
    factory.check_role(Role("linear", "input", "Layer_7"))            # no name rule: fine
    factory.check_role(Role("linear", "input", "decoder.layers.0.mlp.linear_fc2"), named)


@pytest.mark.parametrize("text,message", [
    ("tensor_type=weight", "needs 'field=value:format'"),
    ("module_type=dpa:mxfp8", "module_type 'dpa' selects no slot our formats apply to"),
    ("tensor_type=qkv:mxfp8", "tensor_type selects no operand of a linear GEMM"),
    ("tensortype=weight:mxfp8", "'tensortype=weight' in rule"),
    ("tensor_type=weight:mxfp9", "'mxfp9' is not a known format; valid: fp8_e4m3"),
    ("name~=layers.(:hp", "is not a regular expression"),
])
def test_factory_rule_mistakes_name_the_variable(text, message):
    with pytest.raises(factory.FactoryError, match="LOWP_TE_ROLE_FORMATS") as err:
        factory.parse_rules(text)
    assert message in str(err.value)


def test_factory_default_format_and_te_version_checks():
    assert factory.default_format({"CUSTOM_QUANT_TYPE": "nvfp4"}) == "nvfp4"
    with pytest.raises(factory.FactoryError, match="CUSTOM_QUANT_TYPE is not set"):
        factory.default_format({})
    with pytest.raises(factory.FactoryError, match="'mxfp9' is not a known format"):
        factory.default_format({"CUSTOM_QUANT_TYPE": "mxfp9"})
    for ok in ("2.16.0", "2.20.0.dev0", "3.0.1"):
        factory.check_te_version(ok)
    for old in ("2.15.2", "2.9.0", "1.13"):
        with pytest.raises(factory.FactoryError) as err:
            factory.check_te_version(old)
        line = str(err.value)
        assert len(line.splitlines()) == 1 and f"Transformer Engine {old} is too old" in line
        assert "transformer-engine >= 2.16" in line


def test_factory_without_transformer_engine_is_one_line():
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine imports here")
    except Exception:
        pass
    with pytest.raises(factory.FactoryError, match=r"needs Transformer Engine >= 2\.16, which does not import"):
        factory.make_factory("mxfp8")(Role("linear", "input"))


def test_layouts_follow_the_gemm_plan():
    """Each TE layout (rowwise: the tensor, columnwise: its transpose) is blocked along the
    axis quant.gemm_plan gives the operand it feeds: the GEMM's reduction axis."""
    for (operand, usage), gemm in LAYOUT_GEMM.items():
        assert gemm_plan.axis(gemm, operand) % 2 == emulated_gemm.AXIS_OF_USAGE[usage] % 2
        assert gemm_plan.plan(gemm, operand).operand == operand
    assert {k[0] for k in LAYOUT_GEMM} == set(LINEAR_OPERANDS)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "hifp8", "fp8_e4m3_tensor"])
def test_emulated_gemms_equal_our_linear_emulation(fmt):
    """fprop / dgrad / wgrad as TE's custom GEMM calls qgemm (a @ b.T on the layouts it
    picks) give our emulation's numbers (quant.gemm_plan with quant.quantize)."""
    x, w, dy = _operand((48, 64), 7), _operand((96, 64), 8), _operand((48, 96), 9)
    row_q, col_q = (emulated_gemm.layout_quantizer(fmt, u) for u in ("rowwise", "columnwise"))
    rows = lambda t: emulated_gemm.usage_values(t, row_q, "rowwise")       # noqa: E731
    cols = lambda t: emulated_gemm.usage_values(t, col_q, "columnwise")    # noqa: E731
    q = gemm_plan.format_quantizer(fmt)
    # the operands themselves are bit-identical to the plan's
    assert torch.equal(cols(w).t(), quant.quantize(w, fmt, axis=0))
    assert torch.equal(cols(dy).t(), quant.quantize(dy, fmt, axis=0))
    assert torch.equal(rows(x), quant.quantize(x, fmt, axis=-1))
    f32 = torch.float32
    torch.testing.assert_close(emulated_gemm.hp_gemm(rows(x), rows(w), f32),
                               gemm_plan.linear_forward(x, w, None, q), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(emulated_gemm.hp_gemm(rows(dy), cols(w), f32),
                               gemm_plan.linear_dgrad(dy, w, q), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(emulated_gemm.hp_gemm(cols(dy), cols(x), f32),
                               gemm_plan.linear_wgrad(dy, x, q), rtol=1e-6, atol=1e-6)
    # quantization really happened (not an identity)
    assert not torch.equal(rows(x), x)


def test_hp_gemm_bias_accumulate_and_dtype():
    a, b = _operand((4, 8), 10), _operand((3, 8), 11)
    bias = torch.arange(3.0)
    ref = a.double() @ b.double().t() + bias.double()
    y = emulated_gemm.hp_gemm(a, b, torch.bfloat16, bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, (a @ b.t() + bias).to(torch.bfloat16))
    out = torch.ones(4, 3)
    assert emulated_gemm.hp_gemm(a, b, torch.float32, out=out, accumulate=True) is out
    torch.testing.assert_close(out.double(), ref - bias.double() + 1, rtol=1e-5, atol=1e-5)


def test_names_table_covers_te_and_our_namespace():
    assert names.tensor_names("transformer_engine") == ("activation", "weight", "gradient",
                                                       "output", "dgrad", "wgrad")
    assert names.tensor_names("lowp") == ("query", "key", "value", "probs", "context")
    assert names.slot("transformer_engine", "gradient").axis == gemm_plan.axis("dgrad", "grad_output")
    assert names.slot("lowp", "value").axis == gemm_plan.axis("pv", "value")
    assert names.layer_index("model.module.decoder.layers.1.self_attention.core_attention") == 0
    assert names.layer_index("decoder.layers.3.mlp.linear_fc1") == 3
    assert names.layer_index("output_layer") is None


# -- real Transformer Engine (a GPU machine with TE) ---------------------------------------------
def _te_or_skip():
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:
        pytest.skip(f"Transformer Engine does not import here ({type(exc).__name__}); the "
                    "factory's numerics are tested above without it")
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine needs a CUDA GPU")
    return te


def test_te_linear_under_the_factory_matches_our_emulation():
    te = _te_or_skip()
    from transformer_engine.common.recipe import CustomRecipe

    factory.check_te_version(factory.installed_te_version())
    torch.manual_seed(0)
    layer = te.Linear(64, 96, bias=False, params_dtype=torch.float32).cuda()
    x = _operand((32, 64), 12).cuda().requires_grad_()
    with te.autocast(enabled=True, recipe=CustomRecipe(qfactory=factory.make_factory("mxfp8"))):
        y = layer(x)
    want = gemm_plan.linear_forward(x.detach(), layer.weight.detach(), None,
                                    gemm_plan.format_quantizer("mxfp8"))
    torch.testing.assert_close(y.detach(), want, rtol=1e-5, atol=1e-5)


# -- our namespace on the tiny Llama (real megatron-core; megatron tier) -----------------------
def test_tiny_llama_attention_follows_the_same_yaml(tmp_path):
    """Loading our feature folder routes our Megatron attention capture points through the
    ``lowp`` namespace: the YAML's layer pattern picks one attention layer's query / key /
    value (named by infer_and_assign_layer_names: layers.1 is megatron's layer_number 1, our
    layer 0), captured with our names and metadata; what-if numbers are logged; end_debug
    takes the route away again."""
    import torch.multiprocessing as mp
    from te_helpers import attention_worker

    from tensor_capture import schema
    from tensor_capture.patcher import prepare_patched_megatron as prepare
    from training_driver.megatron_env import free_port

    caps = tmp_path / "caps"
    config = _write(tmp_path, f"""
attention:
  enabled: True
  layers:
    layer_name_regex_pattern: .*layers\\.1\\.self_attention\\.core_attention$
  lowp:
    LowpCapture:
      enabled: True
      tensors: [query, key, value, probs]
      save_dir: {caps}
    LowpWhatIf:
      enabled: True
      tensors: [query, context, probs]
      formats: [mxfp8, nvfp4]
te_linears:
  enabled: True
  layers:
    layer_name_regex_pattern: .*linear_fc1$
  transformer_engine:
    LowpWhatIf: {{enabled: True, tensors: [activation]}}
""")
    patched = str(prepare(tmp_path / "patched"))
    mp.spawn(attention_worker, args=(patched, free_port(), str(tmp_path), str(config)),
             nprocs=1, join=True)
    res = torch.load(tmp_path / "result.pt", weights_only=True)
    assert res["megatron_file"].startswith(patched)
    assert not res["active_before"] and res["active_during"]
    assert not res["active_after"] and res["inspector_after"]
    assert torch.isfinite(res["loss"]).all()

    recs = list(schema.read_manifest(caps))
    name = "model.decoder.layers.1.self_attention.core_attention"
    assert sorted(r["tensor_name"] for r in recs) == ["key", "probs", "query", "value"]
    # P of P·V from the probabilities hook: every row a softmax (sums to 1), [b*heads, sq, sk]
    p, _ = schema.load_tensor_file(caps / next(r["file"] for r in recs if r["tensor_name"] == "probs"))
    assert list(p.shape) == [8, 32, 32]
    assert torch.allclose(p.double().sum(-1), torch.ones(8, 32, dtype=torch.float64), atol=1e-5)
    for r in recs:
        assert (r["layer_type"], r["operation"], r["phase"], r["component"]) == (
            "attention", "forward", "pre", "FA")
        assert r["module_path"] == name and r["layer_idx"] == 0 and r["iteration"] == 0
    q, meta = schema.load_tensor_file(caps / next(r["file"] for r in recs
                                                  if r["tensor_name"] == "query"))
    assert list(q.shape) == [32, 2, 4, 16]          # [sq, b, heads, head_dim]
    k, _ = schema.load_tensor_file(caps / next(r["file"] for r in recs if r["tensor_name"] == "key"))
    assert list(k.shape) == [32, 2, 2, 16]          # 2 query groups
    vals = res["values"]
    # the query's what-if SQNR, re-derived from the captured query along head_dim (Q·Kᵀ)
    assert vals[f"{name}_query_mxfp8_sqnr_db@0"] == pytest.approx(
        _sqnr(q, quant.quantize(q, "mxfp8", axis=-1)), abs=sqnr_db_bound(q.numel()))
    assert f"{name}_context_nvfp4_sqnr_db@0" in vals
    assert vals[f"{name}_probs_mxfp8_sqnr_db@0"] == pytest.approx(      # along the key axis
        _sqnr(p, quant.quantize(p, "mxfp8", axis=-1)), abs=sqnr_db_bound(p.numel()))
    assert not any("layers.2.self_attention" in k for k in vals)   # the other layer: nothing


@pytest.mark.parametrize("name", ["inspect_te.yaml", "inspect_megatron_lm.yaml"])
def test_example_yamls_load(tmp_path, name):
    """The examples in examples/te are valid (our check, and nvdlfw-inspect's initialize; TE's
    own LogTensorStats needs TE's folder, so it is dropped for the stand-in)."""
    import yaml

    path = ROOT / "examples" / "te" / name
    raw = yaml.safe_load(path.read_text())
    options.validate(raw, str(path))
    for section in raw.values():
        section.get("transformer_engine", {}).pop("LogTensorStats", None)
    initialize(raw, tmp_path / "logs")
    assert debug_api.DEBUG_MANAGER is not None


def test_factory_check_before_a_run(monkeypatch):
    """The launcher's `python -m te_integration.factory --check`: TE version, format, rules."""
    env = {"CUSTOM_QUANT_TYPE": "nvfp4", "LOWP_TE_ROLE_FORMATS": "tensor_type=grad_output:mxfp8"}
    from te_integration import te_patches

    monkeypatch.setattr(factory, "installed_te_version", lambda: "2.20.0")
    monkeypatch.setattr(te_patches, "missing", lambda: [])      # TE's places, checked on TE's
    assert factory.check_environment(env) == (                   # own code: test_te_real.py
        "te_integration.factory.quantizer_factory: Transformer Engine 2.20.0, "
        "CUSTOM_QUANT_TYPE=nvfp4, 1 role rule(s)")
    monkeypatch.setattr(te_patches, "missing", lambda: ["a linear bias (pass --disable-bias-linear)"])
    with pytest.raises(factory.FactoryError, match=r"2\.20\.0 lacks what .* --disable-bias-linear"):
        factory.check_environment(env)
    monkeypatch.setattr(factory, "installed_te_version", lambda: "2.10.1")
    with pytest.raises(factory.FactoryError, match=r"2\.10\.1 is too old .* >= 2\.16"):
        factory.check_environment(env)
    out = _python("from te_integration.factory import main; raise SystemExit(main(['--check']))",
                  CUSTOM_QUANT_TYPE="mxfp8")
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "needs Transformer Engine >= 2.16, which does not import here" in out.stderr
