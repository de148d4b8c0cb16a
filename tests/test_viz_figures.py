"""Figure layout and honest subsets: figures.layout_problems catches what a reader stumbles on
(it can fail: built-to-fail figures below), save_png's tidying fixes it, and a report on a
one-iteration, no-overflow, gradient-heavy capture draws readable layouts."""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from viz_helpers import make_capture

from tensor_viz import figures, pipeline, quick_cli
from tensor_viz.figures import Subset, layout_problems, paginate, save_png, subset_note

RNG = np.random.default_rng(0)


# ------------------------------------------------------------------ the check can fail

def _lines_filling_the_panel():
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(2)
    for k in range(8):                        # flat lines across the whole panel
        ax.plot(x, [10.0 ** -k] * 2, "o-", label=f"tensor {k}")
    ax.set_yscale("log")
    ax.set(xlabel="layer index (0-based)", ylabel="absmax (dimensionless, log scale)")
    fig.suptitle("lines")
    return fig, ax


def test_check_finds_a_legend_over_the_lines():
    fig, ax = _lines_filling_the_panel()
    ax.legend(loc="center")
    assert any("legend covers data" in p for p in layout_problems(fig))
    plt.close(fig)


def test_a_legend_outside_the_panel_covers_nothing():
    fig, ax = _lines_filling_the_panel()
    figures.legend_outside(ax)
    assert layout_problems(fig) == []
    plt.close(fig)



def test_check_finds_overlapping_tick_labels():
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(range(8), range(8))
    ax.set_xticks(range(8), [f"long label {i}" for i in range(8)])
    ax.set(xlabel="x (units)", ylabel="y (units)")
    fig.suptitle("t")
    assert any("x tick labels overlap" in p for p in layout_problems(fig))
    plt.close(fig)


def test_check_finds_colourbar_label_running_into_next_panel():
    """The heatmaps' old layout: colourbar labels against the next panel's y label."""
    fig, axes = figures.grid(3, ncols=3, size=(4.8, 4.0), wspace=0.35)
    for ax in axes:
        im = ax.imshow(RNG.normal(size=(128, 64)) * 0.006, aspect="auto")
        fig.colorbar(im, ax=ax, label=figures.VALUE_AXIS, format="%.4f")
        ax.set(title="t", xlabel="column (index)", ylabel="row (flattened leading dimensions)")
    fig.suptitle("t")
    problems = layout_problems(fig)
    assert any("runs into" in p and "colourbar" in p for p in problems), problems
    plt.close(fig)


def test_check_finds_missing_title_and_labels():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    problems = layout_problems(fig)
    assert "figure has no title" in problems
    assert any("missing axis label" in p for p in problems)
    plt.close(fig)


# ------------------------------------------------------------------ save_png's tidying

def test_small_gradient_histograms_have_readable_ticks(tmp_path):
    fig, axes = figures.grid(6)
    for ax, scale in zip(axes, (1e-3, 5e-4, 1e-5, 2e-2, 1.0, 3e4)):
        ax.hist(RNG.normal(size=4000) * scale, bins=80)
        ax.set_yscale("log")
        ax.set(title=f"scale {scale:g}", xlabel=figures.VALUE_AXIS, ylabel=figures.COUNT_AXIS)
    assert save_png(fig, tmp_path / "h.png", "gradients") == []


def test_short_log_axis_gets_more_than_two_labels():
    fig, ax = plt.subplots()
    ax.bar(["a", "b"], [1.5, 15.0])
    ax.set_yscale("log")
    ax.set(xlabel="format", ylabel="error (%, log)")
    fig.draw_without_rendering()
    before = [t.get_text() for t in figures._ticks_in_view(ax.yaxis)]
    figures.tidy(fig)
    after = [t.get_text() for t in figures._ticks_in_view(ax.yaxis)]
    assert len(before) < figures.MIN_LOG_TICKS <= len(after), (before, after)
    assert after == ["2", "5", "10"]
    plt.close(fig)


def test_title_sits_just_above_a_tall_map():
    fig, ax = plt.subplots(figsize=(8, 16))
    ax.imshow(RNG.normal(size=(60, 1)), aspect="auto")
    ax.set(xlabel="iteration (step)", ylabel="row (name)")
    fig.suptitle("map")
    figures.tidy(fig)
    r = fig.canvas.get_renderer()
    gap = fig._suptitle.get_window_extent(r).y0 - ax.get_tightbbox(r).y1
    assert 0 <= gap < 20, gap           # pixels; matplotlib's default leaves ~170 here
    plt.close(fig)


# ------------------------------------------------------------------ subset notes

def test_subset_notes():
    assert subset_note(79, 79, "tensors") == ""
    assert subset_note(48, 79, "tensors", "chosen by x") == "48 of 79 tensors, chosen by x"
    assert Subset(12, 19, "groups").short() == "12 of 19 groups"
    pages = list(paginate(list(range(19)), 12, "groups"))
    assert [len(p) for _, p, _ in pages] == [12, 7]
    assert [s for s, _, _ in pages] == ["_page1", "_page2"]
    assert pages[1][2].short() == "groups 13-19 of 19"
    assert list(paginate([1, 2], 12, "groups")) == [("", [1, 2], None)]


# ------------------------------------------------------------------ the report, figure by figure

@pytest.fixture(scope="module")
def one_iteration(tmp_path_factory):
    """hifp8 and bf16 (their ranges hold the 600 outliers: no overflow), one iteration, gradients
    at 1e-4 next to activations at 1: what the collector's default run captures."""
    root = tmp_path_factory.mktemp("viz1")
    cap, out = root / "cap", root / "out"
    make_capture(cap, quant_types=("hifp8", "bf16"), iterations=(0,), layers=(0, 1), pairs=False)
    seen: dict[str, dict] = {}
    original = figures.FigureSet.save

    def spy(self, fig, section, name, title, caption, subset=None):
        seen[f"{section}/{name}"] = {
            "panels": [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.axison],
            "titles": [ax.get_title() for ax in fig.axes],
            "images": [im.get_array().shape for ax in fig.axes for im in ax.images],
            "yscales": [ax.get_yscale() for ax in fig.axes],
            "texts": [t.get_text() for ax in fig.axes for t in ax.texts],
            "legend": [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]}
        return original(self, fig, section, name, title, caption, subset)

    figures.FigureSet.save = spy
    try:
        opts = pipeline.Options(workers=1, whatif=("fp8_e4m3", "bf16"), whatif_files=5, progress=False,
                                sample_size=1024)
        result = pipeline.build(cap, out, pipeline.FULL_SECTIONS, opts, quick=True)
    finally:
        figures.FigureSet.save = original
    return result, seen


def test_report_figures_lay_out_cleanly(one_iteration):
    result, _ = one_iteration
    issues = {f.path: f.layout_issues for f in result.figures.figures if f.layout_issues}
    assert not issues, issues


def test_distributions_show_every_group(one_iteration):
    result, seen = one_iteration
    groups = {f"{e.name.quant_type} {e.name.operation} {e.name.tensor_name}" for e in result.dataset.sampled()}
    assert len(groups) > 12          # more than one page holds
    titled = {t for k, v in seen.items() if k.startswith("distributions/value_histograms") for t in v["titles"]}
    assert groups <= titled
    pages = [f for f in result.figures.figures if f.path.startswith("distributions/value_histograms")]
    assert len(pages) == 2 and all(f"of {len(groups)})" in f.title for f in pages)


def test_whatif_figures_say_how_many_tensors(one_iteration):
    result, _ = one_iteration
    n = len({(e.label, e.name.quant_type) for e in result.dataset.entries})
    for f in result.figures.in_section("quantization_analysis"):
        assert f"(5 of {n} tensors)" in f.title, f.title
        assert "seeded round-robin" in f.caption


def test_gradients_beside_activations_use_log_magnitudes(one_iteration):
    result, seen = one_iteration
    assert seen["distributions/box_plots"]["yscales"] == ["log"]
    assert seen["distributions/box_plots"]["panels"][0].get_ylabel() == figures.ABS_VALUE_AXIS
    box = next(f for f in result.figures.figures if f.path == "distributions/box_plots.png")
    assert "log axis" in box.caption
    # the same for histograms of gradients beside activations: binades, not a spike at zero
    assert seen["backward_analysis/forward_vs_backward"]["panels"][0].get_xlabel() == figures.LOG2_AXIS


def test_no_overflow_is_said_not_drawn_as_empty_panels(one_iteration):
    result, seen = one_iteration
    f = next(f for f in result.figures.figures if f.path == "overflow_analysis/overflow_ratios.png")
    assert f.title.startswith("No overflow in any of")
    assert len(seen["overflow_analysis/overflow_ratios"]["panels"]) == 1


def test_one_iteration_draws_nothing_over_iterations_and_says_why(one_iteration):
    """A capture of one iteration (the collector's default) gets no plot over iterations: no
    map, no timeline, no interactive chart; one line each says why, and the page lists it."""
    result, seen = one_iteration
    out = Path(result.figures.out_dir)
    assert not any(k.startswith("numerics_map/") for k in seen)
    assert not list((out / "numerics_map").glob("*.png"))
    why = "needs at least 3 captured iterations; this capture has 1 (iteration 0)"
    (map_line,) = result.figures.in_section("numerics_map")
    assert map_line.placeholder and why in map_line.caption
    assert why in (out / "numerics_map" / "no_data.txt").read_text()
    page = (out / "index.html").read_text()
    not_drawn = page.split("Not drawn, and why")[1].split("</ul>")[0]
    assert f"<b>numerics_map</b>: a map over iterations {why}" in not_drawn
    assert "<svg" not in page and f"the interactive map and timeline (over iterations) {why}" in page


def test_no_placeholder_images_and_every_empty_section_listed(one_iteration):
    """Sections with nothing to draw are a line of the summary, not an image among the figures:
    fp8_analysis (one of hifp8/mxfp8), rank_analysis (one rank), attention_maps (no scores)."""
    result, _ = one_iteration
    out = Path(result.figures.out_dir)
    assert not list(out.rglob("no_data.png"))
    page = (out / "index.html").read_text()
    not_drawn = page.split("Not drawn, and why")[1].split("</ul>")[0]
    for section in ("fp8_analysis", "rank_analysis", "attention_maps", "numerics_map"):
        assert f"<b>{section}</b>: " in not_drawn, section
        assert f"<details class=section id='{section}'" not in page, section
    assert "<details class=section id='distributions'>" in page       # drawn: folded, one click


def test_min_subnormal_line_is_labelled(one_iteration):
    _, seen = one_iteration
    legend = seen["distributions/log2_magnitude"]["legend"]
    assert "hifp8 min subnormal ($2^{-22}$)" in legend and "hifp8 max ($2^{15}$)" in legend
    # bf16's limits (2^-133, 2^128) are far from the data: named in the caption, not drawn
    assert not any(t.startswith("bf16") for t in legend)
    f = next(f for f in one_iteration[0].figures.figures if f.path == "distributions/log2_magnitude.png")
    assert "not drawn: bf16 max (2^128), bf16 min subnormal (2^-133)" in f.caption


def test_quick_view_draws_no_empty_progress_bar(one_iteration, tmp_path, capsys):
    result, _ = one_iteration
    cap = Path(result.catalog.directory)
    assert quick_cli.main(["--tensor_dir", str(cap), "--output_dir", str(tmp_path / "q")]) == 0
    err = capsys.readouterr().err
    assert "reading tensors" in err and "drawing" not in err


def test_attention_probabilities_on_a_sequential_zero_to_one_scale(tmp_path, monkeypatch):
    """Softmax outputs (0..1) on a -1..1 diverging scale sit at its white middle and look blank:
    they get a sequential scale from 0 to 1, and the panel title is not cut."""
    import torch
    from viz_helpers import write_tensor

    cap = tmp_path / "cap"
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 4, 32, 32, generator=g).masked_fill(torch.ones(32, 32).triu(1).bool(), -1e9)
    write_tensor(cap, scores.softmax(-1), layer_type="attention", tensor_name="attention_probs",
                 phase="post", component="FA")
    drawn = {}
    original = figures.FigureSet.save

    def spy(self, fig, section, name, title, caption, subset=None):
        (ax,) = [a for a in fig.axes if a.get_label() != "<colorbar>" and a.axison]
        (im,) = ax.images
        drawn[name] = (im.get_cmap().name, im.norm.vmin, im.norm.vmax, ax.get_title(),
                       [c.get_ylabel() for c in fig.axes if c.get_label() == "<colorbar>"])
        return original(self, fig, section, name, title, caption, subset)

    monkeypatch.setattr(figures.FigureSet, "save", spy)
    opts = pipeline.Options(workers=1, whatif=(), progress=False, sample_size=256)
    result = pipeline.build(cap, tmp_path / "out", ("attention_maps",), opts, quick=False)
    cmap, vmin, vmax, title, bar = drawn["attention_score_maps"]
    assert cmap == "viridis" and (vmin, vmax) == (0.0, 1.0)
    assert "…" not in title and title.startswith("L0 core_attention forward attention_probs")
    assert bar == ["probability (fraction, 0-1, sqrt colour scale)"]
    assert result.figures.figures[0].layout_issues == []


def test_a_ratio_that_is_zero_everywhere_is_one_line_not_a_map(tmp_path):
    """Three iterations (a map is drawn), no overflow anywhere: the overflow map is one line."""
    from tensor_viz import catalog, data, plots_quant

    cap = tmp_path / "cap"
    make_capture(cap, quant_types=("bf16",), iterations=(0, 1, 2), layers=(0,), pairs=False)
    cat = catalog.scan(cap)
    fs = figures.FigureSet(tmp_path / "out")
    plots_quant.draw_numerics_map(data.Dataset(entries=cat.entries), fs, ("absmax", "overflow_ratio"))
    drawn = [f.path for f in fs.figures if not f.placeholder]
    assert drawn == ["numerics_map/map_absmax.png"]
    (line,) = [f for f in fs.figures if f.placeholder]
    rows = len({e.label for e in cat.entries})
    assert line.caption == (f"overflow_ratio is 0 in every one of the {rows} layer x tensor rows at "
                            "each of the 3 iterations, so no map is drawn")
