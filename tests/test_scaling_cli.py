"""The mxfp-scaling-test command: inputs of every kind, outputs, logs, JSON, failures, and
running it as a file and as the installed console script."""
from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from quant_tools import scaling_cli as cli

REPO = Path(__file__).resolve().parents[1]
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - (INFO|ERROR) - ")


def _bf16(shape, seed=0, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


@pytest.fixture()
def inputs(tmp_path):
    """One file of each accepted kind plus bad ones."""
    d = tmp_path / "in"
    d.mkdir()
    torch.save({"tensor": _bf16((64, 32)), "metadata": {"layer": 1}}, d / "saver.pt")
    torch.save(_bf16((40, 40), seed=1, scale=3.0), d / "plain.pt")
    np.save(d / "arr.npy", np.random.default_rng(2).normal(size=(30, 30)).astype(np.float32))
    from safetensors.torch import save_file
    save_file({"w": _bf16((16, 16), seed=3)}, str(d / "st.safetensors"))
    torch.save(torch.arange(12), d / "ints.pt")
    (d / "garbage.pt").write_bytes(b"not a tensor file at all")
    (d / "empty.pt").write_bytes(b"")
    torch.save({"weights": [1, 2]}, d / "notensor.pt")
    torch.save(torch.zeros(8, 8, dtype=torch.bfloat16), d / "zeros.pt")
    withnan = _bf16((20, 20), seed=4)
    withnan[0, 0], withnan[1, 1] = math.nan, math.inf
    torch.save(withnan, d / "nan.pt")
    return d


def _run(argv, cwd):
    """main() in-process with the console captured; returns (code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    real_out, real_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.stdout, sys.stderr = real_out, real_err
        os.chdir(old)
    return code, out.getvalue(), err.getvalue()


def test_every_input_kind_succeeds_with_default_outputs(inputs, tmp_path):
    files = [inputs / n for n in ("saver.pt", "plain.pt", "arr.npy", "st.safetensors")]
    code, out, _ = _run([*files, "--no-plots", "--num-levels", "5"], tmp_path)
    assert code == 0
    assert "Processing 4 tensor(s)..." in out
    for i, f in enumerate(files, start=1):
        assert f"[{i}/4] Processing: {f}" in out
        assert f"✅ Successfully processed: {f}" in out
    assert "Total tensors: 4\nSuccessful: 4\nFailed: 0\n🎉 All tests completed successfully!" in out
    for name in ("saver", "plain", "arr", "st"):
        d = tmp_path / "draw" / "scaling_analysis" / name
        assert (d / "mxfp_scaling_results_fp8_e4m3.txt").is_file()
        log = (d / f"mxfp_scaling_test_{name}_fp8_e4m3.log").read_text(encoding="utf-8")
        lines = [ln for ln in log.splitlines() if ln]
        assert all(STAMP.match(ln) for ln in lines[:3])
        for needle in ("Tensor shape:", "Scale exponent range:", "Level 5/5:",
                       "SCALING FACTOR ANALYSIS & RECOMMENDATIONS",
                       "OVERFLOW/UNDERFLOW ANALYSIS SUMMARY", "Results saved to:",
                       "Test completed at"):
            assert needle in log, (name, needle)
        assert not (d / "mxfp_scaling_test_fp8_e4m3.png").exists()   # --no-plots


def test_failures_do_not_stop_the_others_and_set_the_exit_code(inputs, tmp_path):
    names = ["ints.pt", "saver.pt", "garbage.pt", "missing.pt", "empty.pt", "notensor.pt"]
    code, out, _ = _run([*(inputs / n for n in names), "--no-plots", "--num-levels", "3"],
                        tmp_path)
    assert code == 2        # every failure was a bad file: a user mistake, not the tool's
    assert "Successful: 1\nFailed: 5" in out
    assert f"✅ Successfully processed: {inputs / 'saver.pt'}" in out
    expected = {"ints.pt": "int64 tensor; the sweep needs floating-point",
                "garbage.pt": "not a PyTorch tensor file",
                "missing.pt": "no such file", "empty.pt": "empty (0 bytes)",
                "notensor.pt": "not a tensor"}
    for name, msg in expected.items():
        assert re.search(rf"❌ .*{re.escape(name)}: .*{re.escape(msg)}", out), name
    assert "Traceback" not in out
    assert not (tmp_path / "draw" / "scaling_analysis" / "missing").exists()


def test_zero_and_nonfinite_tensors_are_explained(inputs, tmp_path):
    code, out, _ = _run([inputs / "zeros.pt", inputs / "nan.pt", "--no-plots",
                         "--num-levels", "4", "--elem-format", "fp4_e2m1"], tmp_path)
    assert code == 0
    assert "all values are zero: no max/min alignment exists; using defaults" in out
    assert "Excluded non-finite values: 1 NaN, 1 Inf" in out
    assert (tmp_path / "draw/scaling_analysis/nan/mxfp_scaling_test_nan_fp4_e2m1.log").is_file()


def test_json_to_stdout_and_output_dir_layout(inputs, tmp_path):
    out_dir = tmp_path / "res"
    code, out, err = _run([inputs / "saver.pt", inputs / "plain.pt", "--output-dir", out_dir,
                           "--no-plots", "--num-levels", "6", "--json", "-",
                           "--elem-format", "fp8_e5m2"], tmp_path)
    assert code == 0
    doc = json.loads(out)                       # stdout holds only the JSON
    assert "FINAL SUMMARY" in err
    assert (doc["total"], doc["succeeded"], doc["failed"]) == (2, 2, 0)
    first = doc["tensors"][0]
    assert first["ok"] and len(first["result"]["levels"]) == 6
    assert first["result"]["format"] == "fp8_e5m2"
    assert Path(first["files"]["results"]) == out_dir / "saver" / "mxfp_scaling_results_fp8_e5m2.txt"
    # a single input writes straight into --output-dir; --json PATH writes a file
    single = tmp_path / "one"
    code, _, _ = _run([inputs / "arr.npy", "--output-dir", single, "--no-plots",
                       "--num-levels", "2", "--json", tmp_path / "r.json"], tmp_path)
    assert code == 0
    assert (single / "mxfp_scaling_results_fp8_e4m3.txt").is_file()
    assert json.loads((tmp_path / "r.json").read_text())["tensors"][0]["ok"] is True


def test_same_file_names_get_separate_directories(inputs, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(inputs / "saver.pt", other / "saver.pt")
    assert cli.tensor_names([str(inputs / "saver.pt"), str(other / "saver.pt"), "x.npy"]) == \
        ["saver", "saver_2", "x"]
    code, _, _ = _run([inputs / "saver.pt", other / "saver.pt", "--no-plots", "--num-levels",
                       "2"], tmp_path)
    assert code == 0
    assert (tmp_path / "draw/scaling_analysis/saver_2/mxfp_scaling_test_saver_2_fp8_e4m3.log"
            ).is_file()


@pytest.mark.parametrize("argv,needle", [
    (["--min-scale-exp", "3", "--max-scale-exp", "1"], "--min-scale-exp 3 is greater than"),
    (["--num-levels", "0"], "--num-levels 0: must be at least 1"),
    (["--scale-bits", "9"], "--scale-bits 9"),
    (["--elem-format", "fp3"], "invalid choice"),
])
def test_argument_mistakes_exit_2_with_a_message(inputs, tmp_path, argv, needle):
    code, _, err = _run([inputs / "saver.pt", *argv], tmp_path)
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_plots_are_written(inputs, tmp_path):
    import matplotlib.image as mpimg

    code, out, _ = _run([inputs / "plain.pt", "--num-levels", "5", "--elem-format", "int8",
                         "--output-dir", tmp_path / "p"], tmp_path)
    assert code == 0, out
    for name in ("mxfp_scaling_test_int8.png", "mxfp_scaling_summary_int8.png"):
        img = mpimg.imread(tmp_path / "p" / name)
        assert img.shape[0] > 300 and img.shape[1] > 600
    assert not list((tmp_path / "p").glob(".*tmp*"))


def test_runs_as_a_file_from_the_repo_root_and_as_console_script(inputs, tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, "quant/mxfp_scaling_test.py", str(inputs / "saver.pt"),
                        "--no-plots", "--num-levels", "3", "--output-dir", str(tmp_path / "f")],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "🎉 All tests completed successfully!" in r.stdout
    exe = shutil.which("mxfp-scaling-test")
    if exe is None:
        pytest.skip("the console script is not installed (pip install -e .)")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and "--elem-format" in r.stdout


def test_failed_sweeps_leave_nothing_behind(inputs, tmp_path):
    """A failed sweep left draw/scaling_analysis/<name>/ holding only a
    log. Now its outputs are staged and dropped: no folder, no log, no partial file."""
    names = ["ints.pt", "garbage.pt", "notensor.pt", "nan.pt"]
    code, out, _ = _run([*(inputs / n for n in names), "--num-levels", "3",
                         "--min-scale-exp", "5", "--max-scale-exp", "5"], tmp_path)
    assert code == 2 and "Successful: 1\nFailed: 3" in out      # nan.pt sweeps fine
    root = tmp_path / "draw" / "scaling_analysis"
    assert sorted(p.name for p in root.iterdir()) == ["nan"]
    assert not list(root.rglob(".partial-*"))
    # a failure inside an existing output directory keeps what an earlier run wrote there
    keep = tmp_path / "keep"
    code, _, _ = _run([inputs / "saver.pt", "--output-dir", keep, "--no-plots",
                       "--num-levels", "3"], tmp_path)
    assert code == 0
    before = {p.name: p.read_bytes() for p in keep.iterdir()}
    (inputs / "saver2.pt").write_bytes(b"not a tensor file at all")
    code, _, _ = _run([inputs / "saver2.pt", "--output-dir", keep], tmp_path)
    assert code == 2
    assert {p.name: p.read_bytes() for p in keep.iterdir()} == before


def test_one_level_run_says_why_there_is_no_recommendation(inputs, tmp_path):
    code, out, _ = _run([inputs / "plain.pt", "--num-levels", "1", "--output-dir",
                         tmp_path / "one"], tmp_path)
    assert code == 0, out
    assert "No recommendation: only one exponent was swept" in out
    assert "Best result" not in out and "is stable" not in out
    assert "balanced middle ground" not in out
    for name in ("mxfp_scaling_test_fp8_e4m3.png", "mxfp_scaling_summary_fp8_e4m3.png"):
        assert (tmp_path / "one" / name).is_file()


def test_plots_say_why_they_are_sparse():
    import matplotlib.pyplot as plt

    from quant import scaling_sweep as ss
    from tensor_viz.scaling_plots import summary_figure, sweep_figure

    def texts(fig):
        return [t.get_text() for t in fig.texts] + \
            [t.get_text() for ax in fig.axes for t in ax.texts] + [fig._suptitle.get_text()]

    x = _bf16((64, 64), seed=5)
    one = ss.run_sweep(x, "fp8_e4m3", num_levels=1)
    many = ss.run_sweep(x, "fp8_e4m3", num_levels=9)
    note = "Only 1 level(s) swept (--num-levels 1 asked for): too few points for a curve"
    fig = sweep_figure(one, "g")
    assert texts(fig).count(note) == 1 + len(fig.axes)   # the caption and every panel
    assert any("1 level at" in t for t in texts(fig))
    assert not any(line.get_label().startswith("recommended") for ax in fig.axes
                   for line in ax.get_lines())
    plt.close(fig)
    fig = summary_figure(one, "g")
    assert any(t.startswith("No recommendation: only one exponent") for t in texts(fig))
    plt.close(fig)
    for build in (sweep_figure, summary_figure):
        fig = build(many, "g")
        assert not any("too few points" in t for t in texts(fig))
        assert any(line.get_label().startswith("recommended") for ax in fig.axes
                   for line in ax.get_lines())
        plt.close(fig)
