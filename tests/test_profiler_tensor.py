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


def test_balanced_tensor_is_low_risk() -> None:
    torch.manual_seed(0)
    r = analyze_tensor(torch.randn(256, 64), "act")
    assert r["risk_level"] == "LOW" and r["dim_ratio"] < HIGH_RATIO / 16
    assert set(r["formats"]) >= {"bf16", "mxfp8", "mxfp4"}


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
    assert r["risk_level"] == "HIGH" and any("overflow fp16" in s for s in r["reasons"])
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
    assert [d["risk_level"] for d in data] == ["HIGH", "LOW"]
    assert set(data[0]["formats"]) == {"bf16", "mxfp8"}
    r = run(str(a), str(bad))
    assert r.returncode == 1 and f"{bad}: cannot be read" in r.stderr and "Traceback" not in r.stderr
    assert "Risk: HIGH" in r.stdout and "Suggestion:" in r.stdout
    r = run(str(a), "--formats", "fp7")
    assert r.returncode == 2 and "--formats" in r.stderr and "Traceback" not in r.stderr


def test_text_report_lists_extreme_dimensions() -> None:
    x = torch.randn(32, 40) * torch.logspace(-3, 3, 40)
    text = format_report(analyze_tensor(x, "wide"))
    assert "more dimensions (largest and smallest shown)" in text and "Block dynamic range" in text
