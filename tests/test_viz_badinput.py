"""Bad input never crashes a visualizer: it is counted, reported, and the exit code says
whether anything was drawn (0 drawn, 1 nothing drawn, 2 usage error)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from viz_helpers import Evil, write_plain, write_tensor

from tensor_capture import schema
from tensor_viz import analysis_cli, full, pipeline, quick_cli
from tensor_viz.catalog import scan

REPO = Path(__file__).resolve().parent.parent
FAST = ["--no-progress", "--whatif", "none", "--workers", "1"]


def test_missing_directory_is_a_one_line_usage_error(tmp_path, capsys):
    code = full.main(["--tensor_dir", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "o")] + FAST)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "nope" in err[0] and "no such directory" in err[0] and "Traceback" not in err[0]


def test_file_instead_of_directory(tmp_path, capsys):
    f = tmp_path / "x.pt"
    f.write_bytes(b"")
    assert quick_cli.main(["--tensor_dir", str(f), "--output_dir", str(tmp_path / "o")] + FAST) == 2
    assert "not a directory" in capsys.readouterr().err


def test_bad_option_values(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    assert full.main(["--tensor_dir", str(tmp_path / "d"), "--map-stat", "bogus"] + FAST) == 2
    assert "--map-stat bogus" in capsys.readouterr().err
    assert full.main(["--tensor_dir", str(tmp_path / "d"), "--sample-size", "0"] + FAST) == 2


def test_empty_directory_draws_nothing_and_says_so(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    code = analysis_cli.main(["--tensor_dir", str(tmp_path / "empty"), "--output_dir", str(out)] + FAST)
    captured = capsys.readouterr()
    assert code == 2 and len(captured.err.strip().splitlines()) == 1
    assert "error: nothing could be drawn" in captured.err
    for section in pipeline.ENHANCED_SECTIONS:   # every folder says why it is empty, in words
        assert not list((out / section).glob("*.png")), section
        assert (out / section / "no_data.txt").read_text().startswith(f"{section}: nothing to draw: ")
    assert "Not drawn, and why" in (out / "index.html").read_text()


def _messy_dir(d: Path) -> dict:
    """Good captures mixed with every kind of bad input the issue lists."""
    g = torch.Generator().manual_seed(1)
    write_tensor(d, torch.randn(8, 2, 64, generator=g), quant_type="hifp8")
    write_tensor(d, torch.randn(8, 2, 64, generator=g), quant_type="mxfp8", operation="backward",
                 tensor_name="grad_output")
    good = write_tensor(d, torch.randn(4, 64, generator=g), quant_type="fp8_e4m3", tensor_name="weight")
    truncated = d / "20250908_092156_0004_iter0_linear_L0_forward_pre_linear_fp8_e4m3_rank0_sample0_output.pt"
    truncated.write_bytes(good.read_bytes()[:100])
    (d / "20250908_092156_0005_iter0_linear_L0_forward_pre_linear_hifp8_rank0_sample0_junk.pt").write_bytes(
        os.urandom(300))
    torch.save(Evil(), d / "20250908_092156_0006_iter0_linear_L0_forward_pre_linear_hifp8_rank0_sample0_evil.pt")
    torch.save({"model": {"w": torch.ones(3)}}, d / "checkpoint.pt")             # foreign name
    torch.save({"model": {"w": torch.ones(3)}},                                  # right name, wrong content
               d / "20250908_092156_0007_iter0_linear_L0_forward_pre_linear_hifp8_rank0_sample0_state.pt")
    torch.save(torch.arange(10), d / "20250908_092156_0008_iter0_linear_L0_forward_pre_linear_hifp8_rank0_sample0_ids.pt")
    # Seed formats without manifest: v1 and v2 names, bare tensors.
    torch.save(torch.randn(4, 32, generator=g), d / "20250908_092156_0001_attention_L0_forward_hifp8_query.pt")
    torch.save(torch.randn(4, 32, generator=g).bfloat16(),
               d / "20250908_092156_0009_linear_L1_backward_post_linear_bf16_grad_input.pt")
    (d / "notes.txt").write_text("hello")
    schema.append_manifest(d, 0, {"layer_type": "linear", "operation": "forward", "tensor_name": "gone",
                                  "file": "20250908_092156_0099_iter0_linear_L0_forward_pre_linear_hifp8_rank0_"
                                          "sample0_gone.pt"})
    with open(schema.manifest_path(d, 0), "a") as fh:
        fh.write('{"torn": ')                                                  # crash mid-write
    return {"good": 3, "seed_format": 2}


def test_messy_directory_counts_every_problem(tmp_path, capsys):
    marker = Path("/tmp/viz_test_pwned")
    marker.unlink(missing_ok=True)
    d, out = tmp_path / "messy", tmp_path / "out"
    expect = _messy_dir(d)
    code = full.main(["--tensor_dir", str(d), "--output_dir", str(out)] + FAST)
    text = capsys.readouterr().out
    assert code == 0
    assert not marker.exists(), "a pickle ran code"
    problems = [line.split("\t") for line in (out / "problems.txt").read_text().splitlines()]
    kinds = sorted(p[0] for p in problems)
    assert kinds.count("unsafe") == 1 and any("evil" in p[1] for p in problems if p[0] == "unsafe")
    assert kinds.count("unreadable") == 3          # truncated, random bytes, dict without a tensor
    assert kinds.count("foreign") == 2             # checkpoint.pt (name), integer tensor (content)
    assert kinds.count("missing") == 1
    assert f"skipped or flagged {len(problems)} inputs" in text
    assert "ignored 1 files" in text
    stats = (out / "tensor_stats.txt").read_text()
    assert f"Tensors: {expect['good'] + expect['seed_format']}" in stats
    page = (out / "index.html").read_text()
    assert "unsafe: 1" in page and "checkpoint.pt" in page


def test_seed_format_names_get_stats_from_values(tmp_path):
    d = tmp_path / "old"
    d.mkdir()
    t = torch.tensor([[1.0, -3.0, 0.0, 1e-9]])
    torch.save(t, d / "20250908_092156_0001_attention_L0_forward_hifp8_query.pt")
    catalog, ds, nread = pipeline.load(d, pipeline.Options(workers=1, progress=False, whatif=()))
    (e,) = ds.entries
    assert e.name.schema_version == 1 and e.name.tensor_name == "query" and nread == 1
    assert e.stats["absmax"] == 3.0 and e.stats["zero_count"] == 1 and e.stats["min_nonzero_abs"] == pytest.approx(1e-9)
    assert e.stats["log2_hist"]["counts"][-1] == 1      # the 3.0 in binade 1


def test_single_file_is_drawn(tmp_path, capsys):
    d = tmp_path / "one"
    write_plain(d, torch.randn(16, 2, 32))
    out = tmp_path / "out"
    assert analysis_cli.main(["--tensor_dir", str(d), "--output_dir", str(out)] + FAST) == 0
    assert (out / "distributions" / "value_histograms.png").is_file()
    assert (out / "fp8_analysis" / "no_data.txt").is_file()        # one format only: says why


def test_catalog_reads_no_values(tmp_path, monkeypatch):
    d = tmp_path / "cap"
    for i in range(3):
        write_tensor(d, torch.randn(4, 8), tensor_name=f"t{i}")
    monkeypatch.setattr(schema, "load_tensor_file", lambda *a, **k: pytest.fail("catalog loaded a tensor"))
    cat = scan(d)
    assert len(cat.entries) == 3 and all(e.stats and e.source == "manifest" for e in cat.entries)


def test_scripts_run_from_repo_root(tmp_path):
    d = tmp_path / "cap"
    write_tensor(d, torch.randn(8, 2, 16))
    write_tensor(d, torch.randn(8, 2, 16), operation="backward", tensor_name="grad_input")
    env = dict(os.environ, MPLBACKEND="Agg")
    for script in ("script/quick_visualize.py", "script/visualize_tensors.py",
                   "script/visualization/enhanced_tensor_visualizer.py"):
        r = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, env=env)
        assert r.returncode == 0 and "--tensor_dir" in r.stdout, script
    r = subprocess.run(["bash", "script/one_click_visualize.sh", str(d), str(tmp_path / "draw"), "--no-progress",
                        "--whatif", "none"], cwd=REPO, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "draw" / "quick_analysis.png").is_file() and (tmp_path / "draw" / "index.html").is_file()
    r = subprocess.run(["bash", "script/one_click_visualize.sh", str(tmp_path / "missing"), str(tmp_path / "x")],
                       cwd=REPO, capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no such directory" in r.stderr


def test_stats_only_capture_draws_from_the_manifest(tmp_path, capsys):
    """A stats-only run (no tensor files) still gives overflow, statistics and the numerics map."""
    from tensor_capture.synthetic import write_synthetic_run

    d, out = tmp_path / "stats_only", tmp_path / "out"
    write_synthetic_run(d, quant_types=("mxfp8",), iterations=(0, 1, 2), num_layers=2, ranks=(0, 1),
                        stats_only=True)
    assert not list(d.glob("*.pt"))
    code = analysis_cli.main(["--tensor_dir", str(d), "--output_dir", str(out)] + FAST)
    assert code == 0
    for section in ("statistics", "overflow_analysis", "numerics_map", "rank_analysis", "backward_analysis"):
        assert list((out / section).glob("*.png")) and not (out / section / "no_data.txt").exists(), section
    assert not list((out / "heatmaps").glob("*.png")) and (out / "heatmaps" / "no_data.txt").is_file()
    assert "read values from 0 files" in capsys.readouterr().out


def test_workers_when_threads_run(tmp_path):
    """Another thread alive here changes nothing: the workers (started clean, never forked
    from this process) read and draw, with the results of a run in this process."""
    import threading

    d = tmp_path / "cap"
    for name in ("input", "output", "weight"):        # 4 files or more: read by workers, not inline
        write_tensor(d, torch.randn(8, 2, 32), tensor_name=name)
    write_tensor(d, torch.randn(8, 2, 32), operation="backward", tensor_name="grad_input")
    inline_opts = pipeline.Options(workers=1, progress=False, whatif=())
    _, inline, _ = pipeline.load(d, inline_opts)
    opts = pipeline.Options(workers=2, progress=False, whatif=())
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        _, pooled, _ = pipeline.load(d, opts)
        fs = pipeline.draw(pooled, tmp_path / "out", ("statistics", "rank_analysis"), opts)
    finally:
        stop.set()
        other.join()
    assert [e.sample.tolist() for e in pooled.entries] == [e.sample.tolist() for e in inline.entries]
    assert fs.drawn() == 2 and [f.section for f in fs.figures if f.placeholder] == ["rank_analysis"]
