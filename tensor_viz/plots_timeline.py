"""run_timeline/: a flight recorder's whole run, from its summaries (tensor_viz.diagnose.recorder_view).

One figure of three panels sharing the iteration axis: each layer's absmax (log scale), its
flush-to-zero ratio in the run's format, and its NaN/Inf count, with every trigger the ranks
agreed on marked. A capture without recorder summaries draws nothing here (the section says so).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from tensor_viz.data import Dataset
from tensor_viz.diagnose import recorder_view
from tensor_viz.figures import FigureSet, legend_outside, too_few_iterations

SECTION = "run_timeline"
ITERATION_AXIS = "iteration (training step)"
TRIGGER_COLOUR = "tab:red"
GUARD_COLOUR = "tab:green"


def guard_steps(folder) -> dict[int, str]:
    """iteration -> what the auto-guard changed there ("guard: 4 GEMMs -> fp8_e4m3_tensor")."""
    from tensor_capture.guard import read_decisions

    by_it: dict[int, dict[str, int]] = {}
    for d in read_decisions(folder):
        moves = by_it.setdefault(int(d["iteration"]), {})
        moves[d["to"]] = moves.get(d["to"], 0) + 1
    return {it: "guard: " + ", ".join(f"{n} GEMM{'s' if n > 1 else ''} -> {to}"
                                      for to, n in moves.items())
            for it, moves in sorted(by_it.items())}


def _guard_caption(decided: dict[int, str]) -> str:
    return "; ".join(f"iteration {it}: {text.removeprefix('guard: ')}"
                     for it, text in decided.items())


def draw_run_timeline(ds: Dataset, fs: FigureSet) -> None:
    """The recorder's timeline, or one line saying why there is none."""
    folder = ds.capture_dir
    if not folder or not recorder_view.has_summaries(folder):
        fs.placeholder(SECTION, "no flight recorder summaries in this capture (mode: recorder "
                       "writes them; docs/capture.md \"Recorder mode\")")
        return
    t = recorder_view.timeline(folder)
    its = t["iterations"]
    few = too_few_iterations(its, "the run timeline")
    if few:
        fs.skip(SECTION, "The run's timeline from the flight recorder", few)
        return
    fig, axes = plt.subplots(3, 1, figsize=(10.0, 9.0), squeeze=False)
    ax_abs, ax_flush, ax_bad = axes[:, 0]
    x = np.asarray(its, dtype=float)
    for label, cur in t["layers"].items():
        a = np.asarray(cur["absmax"], dtype=float)
        a[~(a > 0)] = np.nan                       # log scale: zeros and gaps not drawn
        ax_abs.plot(x, a, lw=1.0, label=label)
        ax_flush.plot(x, 100 * np.asarray(cur["flush_ratio"], dtype=float), lw=1.0, label=label)
        ax_bad.plot(x, np.asarray(cur["nonfinite"], dtype=float), lw=1.0, label=label)
    ax_abs.set_yscale("log")
    ax_abs.set(title="absmax per layer (ranks and tensors merged)", ylabel="absmax (log)")
    ax_flush.set(title="flushed to zero in the run's format", ylabel="elements flushed (%)")
    ax_bad.set(title="NaN and Inf", ylabel="non-finite elements (count)")
    for ax in (ax_abs, ax_flush, ax_bad):
        ax.set_xlabel(ITERATION_AXIS)
    for trig in t["triggers"]:
        for ax in (ax_abs, ax_flush, ax_bad):
            ax.axvline(trig["iteration"], color=TRIGGER_COLOUR, lw=0.9, ls="--", alpha=0.8)
        ax_abs.annotate(", ".join(trig["kinds"]), (trig["iteration"], 1.0),
                        xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                        fontsize=7, color=TRIGGER_COLOUR)
    decided = guard_steps(folder)
    for it, text in decided.items():
        for ax in (ax_abs, ax_flush, ax_bad):
            ax.axvline(it, color=GUARD_COLOUR, lw=0.9, ls=":", alpha=0.9)
        ax_flush.annotate(text, (it, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                          va="top", ha="left", fontsize=7, color=GUARD_COLOUR)
    legend_outside(ax_abs, fontsize=7, title="layer", title_fontsize=7)
    fig.subplots_adjust(hspace=0.55, right=0.84, top=0.93, bottom=0.07)
    first_bad = next((its[i] for i in range(len(its))
                      if any(c["nonfinite"][i] for c in t["layers"].values())), None)
    trig_text = ("; ".join(f"{g['iteration']} ({', '.join(g['kinds'])})" for g in t["triggers"])
                 or "none")
    caption = (f"Every iteration the flight recorder summarised ({its[0]}..{its[-1]}, "
               f"{len(its)} iterations), one line per transformer layer: the largest |x| of its "
               "captured tensors over ranks and micro-batches, the share of their elements that "
               "flush to zero in the run's format, and their NaN/Inf count. Dashed lines: the "
               f"triggers the ranks agreed on: {trig_text}. "
               + (f"Dotted lines: the auto-guard's decisions ({_guard_caption(decided)}), each "
                  "applied from the next iteration. " if decided else "")
               + (f"The first non-finite value appears at iteration {first_bad}."
                  if first_bad is not None else "No non-finite value was recorded."))
    fs.save(fig, SECTION, "run_timeline", "The run's timeline from the flight recorder", caption)
