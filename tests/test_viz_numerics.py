"""The report's what-if numerics: the whatif_numerics/ figures, the per-layer
summary table, numerics.csv's short-axis mark and the interactive view in index.html.

A capture of 3 iterations x 2 layers x 2 ranks is written by the real saver with the default
what-if set; every number a figure, table or tooltip shows is re-derived here from the stored
tensors with quant.quantize (SQNR in float64, block amax by zero-padding and reshaping, exponents
by math.frexp), never taken from the metadata the report read.
"""
from __future__ import annotations

import csv
import math
import re
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from error_bounds import sqnr_db_bound

sys.path.insert(0, str(Path(__file__).parent))
from training_helpers import small_data  # noqa: F401  (fixture of the tiny Llama test)
from viz_helpers import DevTools, _save, saver_for

import quant
from quant.formats import WHATIF_FORMATS
from tensor_capture import schema
from tensor_viz import figures, pipeline
from tensor_viz.catalog import scan

ITERATIONS, LAYERS, RANKS = (0, 1, 2), (0, 1), (0, 1)
#: (layer type, pass, tensor, shape, phase): attention heads of 16 are shorter than an MX block
SPECS = (("attention", "forward", "query", (8, 2, 4, 16), "pre"),
         ("attention", "forward", "key", (8, 2, 4, 16), "pre"),
         ("attention", "forward", "context", (8, 2, 64), "post"),
         ("linear", "forward", "input", (8, 2, 64), "pre"),
         ("linear", "forward", "weight", (64, 64), "pre"),
         ("linear", "forward", "output", (8, 2, 64), "post"),
         ("linear", "backward", "grad_output", (8, 2, 64), "pre"),
         ("linear", "backward", "grad_input", (8, 2, 64), "post"))


def _capture(directory: Path, iterations=ITERATIONS, layers=LAYERS, ranks=RANKS) -> None:
    g = torch.Generator().manual_seed(7)
    saver = saver_for(directory, whatif_formats=WHATIF_FORMATS)
    try:
        for it in iterations:
            for layer in layers:
                for rank in ranks:
                    for layer_type, op, name, shape, phase in SPECS:
                        scale = (1e-4 if op == "backward" else 1.0) * (1 + layer) * 2.0 ** it
                        t = torch.randn(shape, generator=g) * scale
                        t.view(-1)[:: 37 + it] *= 50.0 * (1 + it)      # outliers that grow
                        _save(saver, t, layer_type=layer_type, operation=op, tensor_name=name,
                              layer_idx=layer, phase=phase, iteration=it, rank=rank)
    finally:
        saver.close()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The capture, the report of numerics_map + whatif_numerics (one process), and what every
    saved figure held: {name: [{title, lines, bars, medians, xticks}] per axes}."""
    root = tmp_path_factory.mktemp("viznum")
    cap, out = root / "cap", root / "out"
    _capture(cap)
    drawn: dict[str, list[dict]] = {}
    original = figures.FigureSet.save

    def recording_save(self, fig, section, name, title, caption, subset=None):
        panels = []
        for ax in fig.axes:
            if not ax.axison:                          # grid()'s unused cells
                continue
            panels.append({
                "title": ax.get_title(),
                "lines": {ln.get_label(): (ln.get_xdata(), ln.get_ydata()) for ln in ax.lines
                          if not ln.get_label().startswith("_")},
                "bars": {c.get_label(): [(p.get_x() + p.get_width() / 2, p.get_height())
                                         for p in c.patches] for c in ax.containers},
                "medians": [ln.get_ydata() for ln in ax.lines if ln.get_gid() == "median"],
                "xticks": [t.get_text() for t in ax.get_xticklabels()]})
        drawn[name] = panels
        drawn[name + ":caption"] = caption
        return original(self, fig, section, name, title, caption, subset)

    figures.FigureSet.save = recording_save
    try:
        opts = pipeline.Options(workers=1, whatif=(), progress=False, sample_size=256)
        result = pipeline.build(cap, out, ("numerics_map", "whatif_numerics"), opts)
    finally:
        figures.FigureSet.save = original
    return cap, out, result, drawn


def _sqnr(x: torch.Tensor, q: torch.Tensor) -> float:
    x, q = x.double(), q.double()
    noise = float(((x - q) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((x * x).sum()) / noise)


def _block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block amax along the last axis, the axis zero-padded to a whole number of blocks."""
    m = x.double().reshape(-1, x.shape[-1]).abs()
    pad = -m.shape[1] % block
    m = torch.nn.functional.pad(m, (0, pad))
    return m.reshape(m.shape[0], -1, block).amax(-1).reshape(-1)


def _binade(v: float) -> int:
    return math.frexp(v)[1] - 1


def _block_bins(x: torch.Tensor, fmt: str) -> list[int]:
    """The histogram bins of every live block: MX shared exponent, NVFP4 scale binade."""
    spec = quant.get_format(fmt)
    amax = _block_amax(x, spec.block_size)
    live = amax[amax > 0]
    if spec.scaling == "mx":
        return [_binade(float(a)) - spec.emax for a in live]
    s_t = float(x.abs().max()) / (6 * 448)
    e4m3 = quant.quantize((live / 6 / s_t).clamp(2.0 ** -9, 448).float(), "fp8_e4m3")
    return [_binade(float(s)) for s in e4m3]


@pytest.fixture(scope="module")
def stored(report):
    """(entry, tensor) of every stored high-precision tensor of the capture."""
    cap = report[0]
    return [(e, schema.load_tensor_file(e.path)[0]) for e in scan(cap).entries
            if e.path and e.variant == schema.VARIANT_HP]


@pytest.fixture(scope="module")
def worst_sqnr(stored):
    """{fmt: {(label, iteration): lowest SQNR over ranks}}, re-derived with quant.quantize."""
    out: dict[str, dict] = defaultdict(dict)
    for e, t in stored:
        for fmt in WHATIF_FORMATS:
            v = _sqnr(t, quant.quantize(t, fmt, axis=-1))
            k = (e.label, e.name.iteration)
            out[fmt][k] = min(out[fmt].get(k, math.inf), v)
    return out


def test_timeline_has_one_panel_per_format_and_the_rederived_sqnr(report, worst_sqnr, stored):
    _, out, result, drawn = report
    assert (out / "whatif_numerics" / "sqnr_timeline.png").is_file()
    panels = drawn["sqnr_timeline"]
    assert [p["title"] for p in panels] == list(WHATIF_FORMATS)
    for p in panels:
        expected = worst_sqnr[p["title"]]
        labels = {label for label, _ in expected}
        assert set(p["lines"]) == labels                 # one line per layer x tensor
        for label, (x, y) in p["lines"].items():
            assert list(x) == list(range(len(ITERATIONS)))
            want = [expected[(label, it)] for it in ITERATIONS]
            # float32 sums in the report, float64 here: the bound of the largest tensor
            bound = sqnr_db_bound(max(t.numel() for _, t in stored))
            assert np.allclose(y, want, rtol=0, atol=bound), (p["title"], label)
    fig = next(f for f in result.figures.figures if f.path.endswith("sqnr_timeline.png"))
    assert fig.layout_issues == []


def test_block_scale_histograms_count_every_rederived_block(report, stored):
    _, out, _, drawn = report
    assert (out / "whatif_numerics" / "block_scale_hist.png").is_file()
    panels = {p["title"]: p for p in drawn["block_scale_hist"]}
    block_formats = [f for f in WHATIF_FORMATS if quant.get_format(f).block_size]
    assert list(panels) == block_formats
    for fmt in block_formats:
        want: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for e, t in stored:
            for b in _block_bins(t, fmt):
                want[e.name.operation][b] += 1
        got = {op: {round(x): int(h) for x, h in bars} for op, bars in panels[fmt]["bars"].items()}
        assert got == {op: dict(c) for op, c in want.items()}, fmt
    # gradients (1e-4) sit far below activations: the histogram separates the passes
    mx = panels["mxfp8"]["bars"]
    assert max(round(x) for x, _ in mx["backward"]) < min(round(x) for x, _ in mx["forward"])
    assert "short_axis" in drawn["block_scale_hist:caption"]   # the head_dim-16 tensors are named


def test_phase_component_boxes_hold_the_rederived_groups(report, stored):
    _, out, _, drawn = report
    assert (out / "whatif_numerics" / "sqnr_by_phase_component.png").is_file()
    for p in drawn["sqnr_by_phase_component"]:
        fmt = p["title"]
        groups: dict[tuple, list[float]] = defaultdict(list)
        for e, t in stored:
            groups[(e.name.phase, e.name.component)].append(_sqnr(t, quant.quantize(t, fmt, axis=-1)))
        order = [("pre", "FA"), ("post", "FA"), ("pre", "linear"), ("post", "linear")]
        assert p["xticks"] == [f"{ph} {c}\n(n={len(groups[(ph, c)])})" for ph, c in order]
        medians = [float(y[0]) for y in p["medians"]]
        assert np.allclose(medians, [np.median(groups[g]) for g in order], atol=1e-3), fmt


def test_csv_marks_a_tensor_shorter_than_one_block(report):
    _, out, _, _ = report
    with open(out / "numerics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and list(rows[0])[-1] == "short_axis"
    mark = {(r["tensor_name"], r["format"]) for r in rows if r["short_axis"] == "true"}
    assert mark == {(n, f) for n in ("query", "key") for f in ("mxfp8", "mxfp4")}   # 16 < 32
    assert all(r["short_axis"] == "" for r in rows if r["format"] in ("hifp8", "fp8_e4m3_tensor"))
    assert all(r["short_axis"] == "false" for r in rows if r["format"] == "nvfp4")   # 16 = 16
    assert len(rows) == len(ITERATIONS) * len(LAYERS) * len(RANKS) * len(SPECS) * len(WHATIF_FORMATS)


def _per_layer_table(page: str) -> tuple[list[str], list[list[str]]]:
    table = page.split("Largest quantization error per layer")[1].split("</table>")[0]
    header = re.findall(r"<th>(.*?)</th>", table)
    body = [re.findall(r"<td[^>]*>(.*?)</td>", tr) for tr in table.split("<tr>")[2:]]
    return header, body


def test_summary_table_ranks_the_whatif_set_by_rederived_worst_sqnr(report, stored):
    _, out, _, _ = report
    header, body = _per_layer_table((out / "index.html").read_text())
    assert header[2:-1] == list(WHATIF_FORMATS)        # the capture's set, not unscaled fp8_e4m3
    worst: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(lambda: math.inf))
    for e, t in stored:
        for fmt in WHATIF_FORMATS:
            v = _sqnr(t, quant.quantize(t, fmt, axis=-1))
            worst[e.layer_label][fmt] = min(worst[e.layer_label][fmt], v)
    assert [row[0] for row in body] == sorted(worst)
    for row in body:
        w = worst[row[0]]
        assert row[-1].replace("&gt;", ">") == " > ".join(sorted(w, key=lambda f: -w[f]))
        for fmt, cell in zip(WHATIF_FORMATS, row[2:-1]):
            assert cell.startswith(f"{w[fmt]:.1f} dB"), (row[0], fmt, cell)
            # the attention layers' worst MX tensor has 16-wide heads: marked with a dagger
            short = "core_attention" in row[0] and fmt.startswith("mx") and \
                ("query" in cell or "key" in cell)
            assert ("&dagger;" in cell) == short, (row[0], fmt, cell)
        assert "not saved" == row[1]                   # this capture saved no quantized operand


def test_interactive_view_is_inline_svg_without_script(report):
    _, out, _, _ = report
    page = (out / "index.html").read_text()
    assert "<script" not in page.lower() and "http://" not in page.replace(
        "http://www.w3.org/2000/svg", "")
    view = page.split("<h2 id=interactive>")[1].split("<h2 id=problems>")[0]
    # overflow_ratio is 0 in every cell of this capture: one line in numerics_map/, no chart
    assert pipeline.Options().map_stats == ("absmax", "underflow_ratio", "overflow_ratio")
    assert view.count("class=ivmap") == 2 and "Numerics map: overflow_ratio" not in view
    assert "<b>numerics_map</b> (Numerics map: overflow_ratio): overflow_ratio is 0 in every one" in page
    assert view.count("class=ivline") == len(WHATIF_FORMATS)


def _expected_tips(stored, worst_sqnr) -> tuple[str, str]:
    """The hover text of the timeline's lowest point at the last iteration (mxfp8) and of the
    map's largest absmax cell at the last iteration, from the stored tensors."""
    last = ITERATIONS[-1]
    label, v = min(((lab, v) for (lab, it), v in worst_sqnr["mxfp8"].items() if it == last),
                   key=lambda kv: kv[1])
    timeline = f"{label} | iteration {last} | mxfp8 SQNR: {v:.2f} dB"
    amax: dict[str, float] = defaultdict(float)
    for e, t in stored:
        if e.name.iteration == last:
            amax[e.label] = max(amax[e.label], float(t.abs().max()))
    label, a = max(amax.items(), key=lambda kv: kv[1])
    cell = f"{label} | iteration {last} | log2 absmax (binade): {math.log2(a):.4g}"
    return timeline, cell


HOVER_JS = """(function (text) {
  var el = Array.prototype.find.call(document.querySelectorAll('svg title'),
                                     function (t) { return t.textContent === text; });
  if (!el) return null;
  el.parentNode.scrollIntoView({block: 'center', inline: 'center'});
  var b = el.parentNode.getBoundingClientRect();
  return [b.x + b.width / 2, b.y + b.height / 2];
})(%s)"""
HOVERED_JS = """(function () {
  var h = document.querySelectorAll(':hover'); var e = h[h.length - 1];
  var t = e && e.querySelector(':scope > title');
  return t ? [t.textContent, getComputedStyle(e).strokeWidth] : null;
})()"""


def test_interactive_view_in_headless_chromium_hover_shows_the_values(report, stored, worst_sqnr,
                                                                      tmp_path):
    import json

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("chromium is not installed (CI installs it in .ci/run)")
    _, out, result, _ = report
    expected = _expected_tips(stored, worst_sqnr)
    browser = DevTools(chromium, tmp_path / "profile")
    try:
        browser.open(out / "index.html")
        images = browser.js("Array.prototype.map.call(document.images, function (i) "
                            "{ return i.complete && i.naturalWidth > 0; })")
        assert len(images) == result.figures.drawn() and all(images)
        assert browser.js(HOVERED_JS) is None or browser.js(HOVERED_JS)[0] not in expected
        for text in expected:
            at = browser.js(HOVER_JS % json.dumps(text))
            assert at is not None, f"no element with the tooltip {text!r}"
            browser.hover(*at)
            shown, stroke = browser.js(HOVERED_JS)
            assert shown == text
            assert stroke == "2px"                      # the :hover style: the pointer is on it
        assert browser.errors == []
    finally:
        browser.close()


def test_interactive_charts_keep_the_page_bounded_and_say_so():
    """A long run: 300 rows x 500 iterations become 240 rows and evenly spaced iterations
    (first and last kept) within the cell budget, and the chart's note says what is shown."""
    from tensor_viz import interactive
    from tensor_viz.data import Dataset

    rows = [{"label": f"L{i:03d} linear_fc1 forward input", "quant_type": "hifp8", "format": "mxfp8",
             "iteration": it, "sqnr_db": 30.0 - i / 100 - it / 1000, "phase": "pre",
             "component": "linear"} for i in range(300) for it in range(500)]
    (chart,) = interactive.timeline_charts(Dataset(entries=[], numerics=rows))
    n_points = str(chart.svg).count("<circle")
    assert n_points <= interactive.MAX_CELLS
    kept = interactive.columns(interactive.MAX_ROWS, 500)
    assert n_points == interactive.MAX_ROWS * len(kept) and kept[0] == 0 and kept[-1] == 499
    assert chart.note == (f"240 of 300 rows, the first in name order; {len(kept)} of 500 iterations, "
                          "evenly spaced, first and last kept")
    assert "L000 linear_fc1 forward input | iteration 499 | mxfp8 SQNR: 29.50 dB" in str(chart.svg)


def test_one_captured_iteration_gets_no_timeline_but_one_line_why(tmp_path):
    """The embedded default captures one iteration: a timeline of one point per line is a column
    of dots, so none is drawn; one line says why (and the other what-if figures are drawn)."""
    _capture(tmp_path / "cap", iterations=(4,), layers=(0,), ranks=(0,))
    from tensor_viz import numerics_data, plots_numerics

    cat = scan(tmp_path / "cap")
    fs = figures.FigureSet(tmp_path / "out")
    table = numerics_data.rows(cat.entries)
    assert not plots_numerics.draw_timeline(table, fs)
    (line,) = fs.figures
    assert line.placeholder and line.title == "What-if SQNR over training"
    assert line.caption.startswith("the what-if SQNR timeline needs at least 3 captured iterations; "
                                   "this capture has 1 (iteration 4)")
    assert not (tmp_path / "out" / plots_numerics.SECTION).exists()
    assert plots_numerics.draw_phase_component(table, fs)          # drawn within the iteration


def test_a_wgrad_operand_is_measured_against_its_twin_seen_as_tokens_by_features(tmp_path):
    """The wgrad GEMM sees input as [s*b, h]; save_quantized stores it so. The report pairs it
    with the [s, b, h] high-precision file and measures it, instead of listing a mismatch."""
    from quant import metrics
    from tensor_viz.file_reads import PairTask, run_pair

    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(3))
    hp = _save(saver := saver_for(tmp_path), x, operation="backward", tensor_name="input")
    q2d = quant.quantize(x.reshape(16, 64), "mxfp8", axis=0)
    qpath = _save(saver, q2d, operation="backward", variant="quantized",
                  tensor_name=schema.quantized_name("input", wgrad=True))
    saver.close()
    got = run_pair(PairTask(str(hp), str(qpath)))
    assert got["errors"]["sqnr"] == pytest.approx(metrics.sqnr(x.reshape(16, 64), q2d))
    other = _save(saver := saver_for(tmp_path / "b"), torch.zeros(16, 32), operation="backward",
                  variant="quantized", tensor_name="input_quantized_wgrad")
    saver.close()
    assert run_pair(PairTask(str(hp), str(other)))["error"][0] == "mismatch"   # 512 != 1024


# -- Done when: a 3-iteration capture of the tiny Llama, its figures and page in Chromium --------
def test_tiny_llama_report_figures_and_page_in_chromium(small_data, tmp_path):
    """Real megatron-core training with the default what-if set: the timeline has a line per
    layer x tensor with the numbers of numerics.csv (lowest over micro-batches), the block-scale
    histogram holds every MX exponent numerics.csv's range allows, and the page renders in
    Chromium without errors, a hovered point showing its row of numerics.csv."""
    import json

    from training_helpers import run

    from tensor_capture.patcher import prepare_patched_megatron
    from training_driver.megatron_env import free_port

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("chromium is not installed (CI installs it in .ci/run)")
    patched = prepare_patched_megatron(tmp_path / "patched")
    cmd = [sys.executable, "-m", "training_driver.train", "--data-path", small_data["data_path"],
           "--tokenizer", small_data["tokenizer"], "--model", "tiny", "--seq-length", "32",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3",
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    cfg = tmp_path / "capture.yaml"
    cfg.write_text("max_iterations: unlimited\nbyte_budget: unlimited\nwhatif_formats: default\n")
    out = run(cmd, cwd=tmp_path, timeout=600, TENSOR_SAVE_ENABLED="true",
              TENSOR_SAVE_DIR=str(tmp_path / "cap"), TENSOR_SAVE_CONFIG=str(cfg),
              CUSTOM_QUANT_TYPE="mxfp8", MEGATRON_LOWP_PATCHED_DIR=str(patched),
              MASTER_PORT=str(free_port()))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    opts = pipeline.Options(workers=1, whatif=(), progress=False, sample_size=256)
    result = pipeline.build(tmp_path / "cap", tmp_path / "report", ("numerics_map", "whatif_numerics"),
                            opts)
    names = {Path(f.path).name for f in result.figures.figures if f.section == "whatif_numerics"}
    assert {"sqnr_timeline.png", "block_scale_hist.png", "sqnr_by_phase_component.png"} <= names
    assert all(f.layout_issues == [] for f in result.figures.figures)
    with open(tmp_path / "report" / "numerics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {int(r["iteration"]) for r in rows} == {0, 1, 2}
    assert {(r["phase"], r["component"]) for r in rows} >= {("pre", "FA"), ("post", "FA"),
                                                            ("pre", "linear"), ("post", "linear")}
    # the lowest mxfp8 SQNR at iteration 2, from the CSV: the tooltip of that timeline point
    entries = {Path(e.path).name: e for e in scan(tmp_path / "cap").entries if e.path}
    worst = min((float(r["sqnr_db"]), r) for r in rows
                if r["format"] == "mxfp8" and r["iteration"] == "2" and r["file"]
                and math.isfinite(float(r["sqnr_db"])))[1]
    label = entries[worst["file"]].label
    lowest = min(float(r["sqnr_db"]) for r in rows if r["format"] == "mxfp8"
                 and r["iteration"] == "2" and r["file"] and entries[r["file"]].label == label)
    text = f"{label} | iteration 2 | mxfp8 SQNR: {lowest:.2f} dB"
    browser = DevTools(chromium, tmp_path / "profile")
    try:
        browser.open(tmp_path / "report" / "index.html")
        images = browser.js("Array.prototype.map.call(document.images, function (i) "
                            "{ return i.complete && i.naturalWidth > 0; })")
        assert len(images) == result.figures.drawn() and all(images)
        at = browser.js(HOVER_JS % json.dumps(text))
        assert at is not None, f"no point with the tooltip {text!r}"
        browser.hover(*at)
        assert browser.js(HOVERED_JS) == [text, "2px"]
        assert browser.errors == []
    finally:
        browser.close()
