"""The full report on a capture-shaped directory: folders, index.html, summary tables, numbers."""
from __future__ import annotations

import math
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from error_bounds import sqnr_db_bound

sys.path.insert(0, str(Path(__file__).parent))
import figure_checks
from viz_helpers import browser_check, make_capture

from tensor_capture import schema
from tensor_viz import file_reads, pipeline
from tensor_viz.plots_quant import numerics_matrix

WHATIF = ("fp8_e4m3", "mxfp8", "mxfp4", "bf16")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One full build (workers=2) whose every saved figure is checked for title and axis labels."""
    root = tmp_path_factory.mktemp("vizrep")
    cap, out = root / "cap", root / "out"
    make_capture(cap, ranks=(0, 1), iterations=(0, 1, 2))   # 3: the plots over iterations are drawn
    violations = root / "violations.txt"
    figure_checks.install(root)
    real_init = pipeline._set_draw_state
    pipeline._set_draw_state = figure_checks.init_worker_with_checks    # the workers check too
    try:
        opts = pipeline.Options(workers=2, whatif=WHATIF, progress=False, sample_size=2048)
        result = pipeline.build(cap, out, pipeline.FULL_SECTIONS, opts, quick=True)
    finally:
        pipeline._set_draw_state = real_init
        figure_checks.uninstall()
    return cap, out, result, violations


def test_every_folder_filled_or_says_why(built):
    cap, out, result, _ = built
    assert result.exit_code == 0
    for section in pipeline.FULL_SECTIONS:
        pngs = sorted(p.name for p in (out / section).glob("*.png"))
        if section in ("attention_maps", "run_timeline"):
            # no score tensors / no flight recorder summaries in this capture: says why, no image
            assert pngs == [] and (out / section / "no_data.txt").is_file()
        else:
            assert pngs and not (out / section / "no_data.txt").exists(), section
    for name in ("quick_analysis.png", "tensor_stats.txt", "index.html", "problems.txt"):
        assert (out / name).is_file()
    for png in out.rglob("*.png"):
        img = __import__("matplotlib.image", fromlist=["imread"]).imread(png)
        assert img.shape[0] > 100 and img.shape[1] > 200, png


def test_figures_have_titles_labels_units(built):
    _, _, result, violations = built
    assert not violations.exists(), violations.read_text()
    checked = (violations.parent / "checked.txt").read_text().split()
    assert len(checked) == len([f for f in result.figures.figures      # every figure drawn
                                if f.section != "quick" and not f.placeholder])
    assert all(f.title and f.caption for f in result.figures.figures)


def test_every_figure_lays_out_cleanly(built):
    """Each saved figure (quick view included) passed figures.layout_problems: a title, axis
    labels, no tick labels overlapping, no text of one panel running into another's."""
    _, _, result, _ = built
    assert len(result.figures.figures) > 20
    issues = {f.path: f.layout_issues for f in result.figures.figures if f.layout_issues}
    assert not issues, issues


def test_index_links_and_summary(built):
    cap, out, result, _ = built
    page = (out / "index.html").read_text()
    srcs = re.findall(r"<img src='([^']+)'", page)
    # attention_maps and run_timeline (no flight recorder here) say why instead of an image
    assert len(srcs) == result.figures.drawn() == len(result.figures.figures) - 2
    assert "no_data" not in " ".join(srcs)
    for src in srcs:
        assert not src.startswith(("/", "file:", "http")), src
        assert (out / src).is_file(), src
    not_drawn = page.split("Not drawn, and why")[1].split("</ul>")[0]   # attention_maps says why
    assert "<b>attention_maps</b>: no attention score/probability tensors were captured" in not_drawn
    # Worst overflow: the linear outputs with 600/1200 outliers under fp8_e4m3 (max 448).
    table = page.split("Worst overflow")[1].split("</table>")[0]
    rows = re.findall(r"<tr><td>(.*?)</td>", table)
    assert rows and all("output" in r for r in rows[:4])
    assert "fp8_e4m3" in table
    per_layer = page.split("Largest quantization error per layer")[1].split("</table>")[0]
    assert "L0 linear_fc1" in per_layer and "L1 linear_fc1" in per_layer
    assert "not computed" not in per_layer


def test_overflow_ratio_matches_values(built):
    cap, out, result, _ = built
    worst = max((e for e in result.dataset.entries if e.name.quant_type == "fp8_e4m3"),
                key=lambda e: e.range_stats()[1]["overflow_ratio"])
    t, _ = schema.load_tensor_file(worst.path)
    expected = float((t.float().abs() > 448).sum()) / t.numel()
    assert worst.range_stats()[1]["overflow_ratio"] == pytest.approx(expected)
    assert expected > 0


def test_quick_stats_exact(built):
    cap, out, result, _ = built
    text = (out / "tensor_stats.txt").read_text()
    allv = torch.cat([schema.load_tensor_file(p)[1] and schema.load_tensor_file(p)[0].reshape(-1).double()
                      for p in sorted(cap.glob("*.pt"))])
    assert f"Tensors: {len(list(cap.glob('*.pt')))}" in text
    mean = float(re.search(r"Mean: (\S+)", text).group(1))
    std = float(re.search(r"Std: (\S+)", text).group(1))
    assert mean == pytest.approx(float(allv.mean()), rel=1e-4, abs=1e-6)
    assert std == pytest.approx(float(allv.std(unbiased=False)), rel=1e-4)
    n_bf16 = len([p for p in cap.glob("*.pt") if schema.parse_filename(p.name).quant_type == "bf16"])
    assert f"bf16: {n_bf16} files" in text


def test_numerics_map_cells_are_stored_stats(built):
    _, _, result, _ = built
    ds = result.dataset
    rows, cols, m = numerics_matrix(ds, "absmax")
    assert cols == ["0", "1", "2"]
    e = next(e for e in ds.entries if e.name.tensor_name == "output" and e.name.quant_type == "hifp8"
             and e.name.iteration == 1 and e.name.layer_idx == 1)
    row = rows.index(f"{e.label} [hifp8]")
    same = [x for x in ds.entries if f"{x.label} [{x.name.quant_type}]" == rows[row] and x.name.iteration == 1]
    assert m[row, 1] == pytest.approx(math.log2(max(x.stats["absmax"] for x in same)))


def test_whatif_and_measured_errors_use_quant(built):
    """This capture stored no what-if numbers: the report recomputes the asked formats from the
    saved tensors, along the last axis (the records name no GEMM axis), and says so."""
    pytest.importorskip("quant.fakequant")
    from quant import metrics, quantize

    _, _, result, _ = built
    rows = [r for r in result.dataset.numerics if r["format"] in WHATIF]
    assert rows and {r["source"] for r in rows} == {"recomputed"}
    for r in rows[:: max(1, len(rows) // 12)]:
        e = next(e for e in result.dataset.entries if e.path and e.path.endswith(r["file"]))
        t, _ = schema.load_tensor_file(e.path)
        x = t.double()
        noise = float(((x - quantize(t, r["format"], axis=-1).double()) ** 2).sum())
        want = math.inf if noise == 0 else 10 * math.log10(float((x * x).sum()) / noise)
        assert r["sqnr_db"] == pytest.approx(want, abs=sqnr_db_bound(t.numel())), (
            r["file"], r["format"])
    assert result.dataset.pairs
    p = next(p for p in result.dataset.pairs if p.hp.dtype == "torch.float32")
    hp, _ = schema.load_tensor_file(p.hp.path)
    q, _ = schema.load_tensor_file(p.quantized.path)
    assert p.errors["relative_error"] == pytest.approx(metrics.relative_error(hp, q))
    assert p.errors["relative_error"] > 0


def test_sampling_is_reproducible(built):
    cap, _, _, _ = built
    path = str(sorted(cap.glob("*weight.pt"))[0])
    a = file_reads.run_file(file_reads.FileTask(path, sample_size=100, seed=3))["sample"]
    b = file_reads.run_file(file_reads.FileTask(path, sample_size=100, seed=3))["sample"]
    c = file_reads.run_file(file_reads.FileTask(path, sample_size=100, seed=4))["sample"]
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    t, _ = schema.load_tensor_file(path)
    assert np.isin(a, t.float().numpy()).all()


def test_report_in_headless_chromium(built, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("chromium is not installed (CI installs it in .ci/run)")
    _, out, result, _ = built
    check = browser_check(out / "index.html", chromium, tmp_path / "profile")
    assert check["images"] == result.figures.drawn() > 20
    assert check["bad"] == []
    assert check["errors"] == []


def test_markup_in_names_and_paths_is_escaped(tmp_path):
    """A tensor name, a directory and a bad file holding <script> and & show as text, not markup."""
    from viz_helpers import write_plain

    cap, out = tmp_path / "cap<b>&x", tmp_path / "out"
    evil = "a<script>alert(1)<&script>&b"
    plain = write_plain(cap, torch.zeros(1), quant_type="fp8_e4m3")
    t = torch.linspace(-1, 1, 256).reshape(4, 64)
    t[0, :5] = 1000.0                          # overflow under fp8_e4m3: the name is in a table
    name = schema.parse_filename(plain.name)
    torch.save({"tensor": t, "metadata": {**name.to_dict(), "tensor_name": evil}},
               plain.with_name(plain.name.replace("_input.pt", f"_{evil}.pt")))
    plain.unlink()
    (cap / "bad<i>&.pt").write_bytes(b"junk")
    opts = pipeline.Options(workers=1, whatif=(), progress=False, sample_size=256)
    result = pipeline.build(cap, out, ("overflow_analysis",), opts, quick=False)
    assert result.exit_code == 0
    page = (out / "index.html").read_text()
    assert "<script" not in page.lower() and "cap<b>" not in page and "<i>" not in page
    escaped = "a&lt;script&gt;alert(1)&lt;&amp;script&gt;&amp;b"
    overflow = page.split("Worst overflow")[1].split("</table>")[0]
    assert f"<td>L0 linear forward {escaped}</td>" in overflow
    assert "cap&lt;b&gt;&amp;x</code>" in page
    assert "bad&lt;i&gt;&amp;.pt</td>" in page
    assert re.search(r"&(?!(amp|lt|gt|#39|#34);)", page.split("</style>")[1]) is None  # no bare &
