"""analyze_tensor and the analyze-tensor command."""
from __future__ import annotations

import json

import pytest
import torch

import quant
from training_profiler import analyze_tensor
from training_profiler.tensor_analyzer import HIGH_RATIO, block_dynamic_range, format_report, main


def test_seed_example_dimension_imbalance() -> None:
    x = torch.tensor([[-1000.0, -1.5], [1200.0, 0.8], [100.0, 0.1]])
    r = analyze_tensor(x, "bbox_pred")
    assert r["shape"] == (3, 2)
    assert r["dim_stats"][0] == {"min": -1000.0, "max": 1200.0, "mean": 100.0, "absmax": 1200.0}
    assert r["dim_stats"][1]["min"] == -1.5 and r["dim_stats"][1]["max"] == pytest.approx(0.8)
    assert r["dim_ratio"] == pytest.approx(1200 / 1.5)
    assert r["per_channel_absmax"] == pytest.approx([1200.0, 1.5])
    assert r["risk_level"] == "HIGH" and "FP32" in r["suggestion"] and "Dimension 1" in r["suggestion"]


def test_balanced_tensor_is_low_risk_only_for_formats_that_hold_it() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    r = analyze_tensor(x, "act", formats=["bf16", "fp8_e5m2"])
    assert r["risk_level"] == "LOW" and r["dim_ratio"] < HIGH_RATIO / 16
    assert r["findings"] == [] and r["safe_formats"] == ["bf16", "fp8_e5m2"]
    assert "looks safe" in r["suggestion"] and "bf16, fp8_e5m2" in r["suggestion"]
    # a Gaussian is what every surveyed format is designed for: mxfp4 flushes some of it and
    # fp8 holds some of it in its subnormal range, but no format loses more than on its baseline
    d = analyze_tensor(x, "act")
    assert set(d["formats"]) >= {"bf16", "mxfp8", "mxfp4", "nvfp4", "fp8_e4m3"}
    assert d["formats"]["mxfp4"]["flush_to_zero_ratio"] > 0.01          # the old HIGH
    assert d["risk_level"] == "LOW" and set(d["safe_formats"]) == set(d["formats"])


def test_the_issue_example_a_gaussian_is_not_high_and_a_planted_imbalance_is() -> None:
    from training_profiler.tensor_analyzer import DEFAULT_FORMATS

    torch.manual_seed(0)
    for fmt in DEFAULT_FORMATS:
        r = analyze_tensor(torch.randn(1000, 2), formats=[fmt])
        assert r["risk_level"] == "LOW", (fmt, r["reasons"])
    x = torch.randn(1000, 2)
    x[:, 1] *= 1e-3                                   # one channel 1000x smaller
    r = analyze_tensor(x, formats=["mxfp8"])
    assert r["risk_level"] == "HIGH" and r["findings"][0]["rule"] == "dim_imbalance"
    y = torch.randn(1000, 64)
    y[::40, 3] = 5e4                                  # planted outliers: unscaled fp8 clips them
    r = analyze_tensor(y, formats=["fp8_e4m3"])
    assert r["risk_level"] == "HIGH" and "fp8_e4m3" in r["findings"][-1]["subjects"]


def test_small_gradients_are_not_called_safe() -> None:
    """Gradient-sized values (normal * 1e-6) flush in fp8 and hifp8 and
    underflow fp16; the verdict said LOW / looks safe."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(512, 256, generator=g) * 1e-6).to(torch.bfloat16)
    r = analyze_tensor(x, "grad_key")
    rows = r["formats"]
    assert rows["fp8_e4m3"]["flush_to_zero_ratio"] > 0.99 and rows["fp16"]["underflow_ratio"] > 0.99
    assert r["risk_level"] == "HIGH" and "safe" not in r["suggestion"]
    by_rule = {(f["rule"], f["level"]): f for f in r["findings"]}
    assert {"fp8_e4m3", "fp8_e5m2", "hifp8", "fp16"} <= set(by_rule["format_loss", "HIGH"]["subjects"])
    assert "bf16" in r["safe_formats"] and "fp8_e4m3" not in r["safe_formats"]
    text = format_report(r)
    assert "Risk: HIGH" in text and "fp8_e4m3 (" in text and "dB below" in text
    assert "No rule fired for: " in text and "bf16" in text.split("No rule fired for: ")[1]


def test_verdict_follows_every_format_row_through_quant_format_loss() -> None:
    """Whatever the tensor, a row quant.format_loss calls high (medium) makes the verdict at
    least HIGH (MEDIUM), and a format is listed safe exactly when its row is 'none'."""
    from quant.format_loss import loss_severity
    rank = {"LOW": 0, "MEDIUM": 1, "HIGH": 2, "CANNOT JUDGE": -1}
    g = torch.Generator().manual_seed(7)
    seen = set()
    for scale in (1e-7, 1e-3, 1.0, 300.0, 1e5):
        x = torch.randn(64, 64, generator=g) * scale
        r = analyze_tensor(x, f"x{scale:g}")
        for name, row in r["formats"].items():
            worst = loss_severity(row["sqnr_db"], row["baseline_db"])
            seen.add(worst)
            need = {"none": 0, "medium": 1, "high": 2}[worst]
            assert rank[r["risk_level"]] >= need, (scale, name, row, r["risk_level"])
            assert (name in r["safe_formats"]) == (worst == "none"), (scale, name)
    assert seen == {"none", "high"} or seen == {"none", "medium", "high"}


def test_subnormal_values_count_by_what_they_lose() -> None:
    x = (1 + torch.rand(64, 32)) * 1e-6     # below fp16's min normal, above half its subnormal
    r = analyze_tensor(x, formats=["fp16"])
    row = r["formats"]["fp16"]
    assert row["underflow_ratio"] == 1.0 and row["flush_to_zero_ratio"] == 0.0
    assert row["deficit_db"] > 15                       # a few bits left of fp16's eleven
    assert [(f["rule"], f["level"], f["subjects"]) for f in r["findings"]] == \
        [("format_loss", "HIGH", ["fp16"])]
    # a few tiny values among large ones flush in fp8_e4m3 but carry no signal: not a risk
    y = torch.ones(100, 40)
    y.view(-1)[:60] = 1e-4
    assert quant.analyze_quantization(y, "fp8_e4m3").flush_to_zero_ratio == 60 / 4000
    assert analyze_tensor(y, formats=["fp8_e4m3"])["risk_level"] == "LOW"
    z = torch.ones(4000, 1)                    # one channel: no dimension ratio
    z.view(-1)[:8] = 1000.0                    # 0.2 % saturate at 448: most of the energy lost
    r = analyze_tensor(z, formats=["fp8_e4m3", "bf16"])
    assert r["risk_level"] == "HIGH" and r["findings"][0]["rule"] == "format_loss"
    assert r["safe_formats"] == ["bf16"]


def test_all_zeros_and_too_few_values_cannot_be_judged() -> None:
    z = analyze_tensor(torch.zeros(64, 64), "z")
    assert z["risk_level"] == "CANNOT JUDGE" and z["safe_formats"] == []
    assert "all 4096 finite values are zero" in z["suggestion"] and "safe" not in z["suggestion"]
    few = analyze_tensor(torch.randn(16, 8), "few", formats=["bf16"])
    assert few["risk_level"] == "CANNOT JUDGE" and "only 128 nonzero finite values" in few["suggestion"]
    assert "cannot judge: only 128" in format_report(few)
    # found risks stand however few the values are
    bad = torch.ones(4, 4)
    bad[0, 0] = float("inf")
    r = analyze_tensor(bad, formats=["bf16"])
    assert r["risk_level"] == "HIGH" and r["cannot_judge"]


def test_every_rule_of_the_table_fires_on_its_case() -> None:
    from training_profiler.tensor_verdict import RULES

    imbalanced = torch.stack([torch.full((2000,), 1000.0), torch.full((2000,), 1.0)], 1)
    mid = torch.stack([torch.full((2000,), 32.0), torch.full((2000,), 1.0)], 1)
    cases = {"nonfinite": (torch.tensor([1.0, float("nan")] * 600), ["bf16"]),
             "dim_imbalance": (imbalanced, ["bf16"]),
             "dtype_overflow": (torch.full((2000,), 1e5), ["fp16"]),
             "format_loss": (torch.full((2000,), 1e-6), ["fp16"])}
    assert set(cases) == {rule.id for rule in RULES}, "add a case for the new rule"
    for rule_id, (x, formats) in cases.items():
        r = analyze_tensor(x, rule_id, formats=formats)
        assert rule_id in {f["rule"] for f in r["findings"]}, (rule_id, r["findings"])
    assert analyze_tensor(mid, formats=["bf16"])["risk_level"] == "MEDIUM"


def test_format_fractions_come_from_quant() -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 64) * 300
    r = analyze_tensor(x, formats=["fp8_e4m3", "fp16"])
    a = quant.analyze_quantization(x, "fp8_e4m3")
    assert r["formats"]["fp8_e4m3"]["overflow_ratio"] == a.overflow_ratio > 0
    assert r["formats"]["fp16"]["overflow_ratio"] == 0


def test_fp16_overflow_and_nonfinite_raise_risk() -> None:
    x = torch.ones(8, 4)
    x[0, 0] = 1e6
    r = analyze_tensor(x, formats=["fp16"])
    assert r["risk_level"] == "HIGH" and any("overflow to Inf in fp16" in s for s in r["reasons"])
    y = torch.ones(8, 4)
    y[1, 1] = float("nan")
    r = analyze_tensor(y, formats=[])
    assert r["nan_count"] == 1 and r["risk_level"] == "HIGH" and r["dim_stats"][1]["max"] == 1.0


def test_block_dynamic_range_exact() -> None:
    row = torch.ones(1, 64)
    row[0, 0] = 2.0 ** 10       # first block spans 10 binades
    row[0, 32] = 2.0 ** -3      # second block spans 3
    b = block_dynamic_range(row, 32)
    assert b["blocks"] == 2 and b["max_bits"] == 10.0 and b["median_bits"] == 3.0  # lower median
    # MXFP4 elements span log2(6 / 0.5) = 3.58 binades: only the first block exceeds that.
    assert b["fraction_beyond_mxfp4"] == 0.5
    assert b["fraction_beyond_mxfp8"] == 0.0


def test_bad_input_is_clear() -> None:
    with pytest.raises(ValueError, match="x: analyze_tensor needs a floating-point tensor"):
        analyze_tensor(torch.arange(4), "x")


def test_cli_on_saved_files(tmp_path, capsys) -> None:
    a = tmp_path / "imbalanced.pt"
    torch.save({"tensor": torch.stack([torch.linspace(-900, 900, 64), torch.linspace(-1, 1, 64)], 1),
                "metadata": {"module_path": "head.bbox"}}, a)
    b = tmp_path / "bare.pt"
    torch.save(torch.randn(16, 8), b)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a tensor")
    class Result:
        def __init__(self, code, out, err):
            self.returncode, self.stdout, self.stderr = code, out, err

    def run(*args):
        code = main(list(args))
        out, err = capsys.readouterr()
        return Result(code, out, err)

    r = run(str(a), str(b), "--format", "json", "--formats", "bf16,mxfp8")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [d["risk_level"] for d in data] == ["HIGH", "CANNOT JUDGE"]   # 128 values: too few
    assert set(data[0]["formats"]) == {"bf16", "mxfp8"}
    r = run(str(a), str(bad))
    assert r.returncode == 2 and f"{bad}: cannot be read" in r.stderr and "Traceback" not in r.stderr
    assert "Risk: HIGH" in r.stdout and "Suggestion:" in r.stdout
    r = run(str(a), "--formats", "fp7")
    assert r.returncode == 2 and "--formats" in r.stderr and "Traceback" not in r.stderr


def test_text_report_lists_extreme_dimensions() -> None:
    x = torch.randn(32, 40) * torch.logspace(-3, 3, 40)
    text = format_report(analyze_tensor(x, "wide"))
    assert "more dimensions (largest and smallest shown)" in text and "Block dynamic range" in text
