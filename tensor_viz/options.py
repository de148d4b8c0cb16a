"""Settings and names shared by the library and the command line (kept import-light, so
``--help`` answers without loading torch or matplotlib)."""
from __future__ import annotations

from dataclasses import dataclass

from quant.formats import SURVEY_FORMATS  # the format table; loads no torch
from tensor_viz.workers import DEFAULT_TIMEOUT_S  # standard library only

DEFAULT_WHATIF = SURVEY_FORMATS
MAP_STAT_NAMES = ("absmax", "std", "overflow_ratio", "underflow_ratio", "flush_to_zero_ratio")
DEFAULT_MAP_STATS = ("absmax", "underflow_ratio", "overflow_ratio")

# The twelve draw/ folders users of the first visualizer know, in their order, then ours.
ORIGINAL_SECTIONS = ("distributions", "heatmaps", "comparisons", "statistics", "attention_analysis",
                     "quantization_analysis", "layer_analysis", "overflow_analysis", "fp8_analysis",
                     "bf16_analysis", "backward_analysis", "rank_analysis")
ENHANCED_SECTIONS = ORIGINAL_SECTIONS + ("numerics_map", "whatif_numerics")

#: Every report section (a draw/ folder), in index.html order: (name, "plots module:function",
#: what the section answers). The one list of sections: a new plot family is its
#: tensor_viz/plots_<family>.py plus one row here. Names only, so --help loads no matplotlib.
SECTION_TABLE: tuple[tuple[str, str, str], ...] = (
    ("distributions", "plots_basic:draw_distributions",
     "What the values look like, per quant type, pass and tensor."),
    ("heatmaps", "plots_basic:draw_heatmaps",
     "Where in a tensor the large values sit (rows = tokens, columns = channels)."),
    ("comparisons", "plots_basic:draw_comparisons", "How the quant types compare."),
    ("statistics", "plots_basic:draw_statistics",
     "Statistics of every captured tensor (stored at capture time)."),
    ("attention_analysis", "plots_basic:draw_attention_analysis", "Attention inputs and outputs."),
    ("attention_maps", "plots_basic:draw_attention_maps",
     "Attention score maps, where they were captured."),
    ("quantization_analysis", "plots_quant:draw_quantization",
     "Quantization error, measured and what-if."),
    ("layer_analysis", "plots_analysis:draw_layers",
     "Attention vs linear, layer index, sample and batch size."),
    ("overflow_analysis", "plots_analysis:draw_overflow",
     "Overflow, underflow and flush-to-zero against each format."),
    ("fp8_analysis", "plots_analysis:draw_fp8", "HiFP8 vs MXFP8 runs."),
    ("bf16_analysis", "plots_analysis:draw_bf16",
     "BF16 tensors: raw and normalized densities, shape statistics."),
    ("backward_analysis", "plots_analysis:draw_backward", "Forward vs backward, gradients."),
    ("rank_analysis", "plots_analysis:draw_ranks", "The same tensor across ranks."),
    ("numerics_map", "plots_quant:draw_numerics_map",
     "A layer x tensor map of one statistic over iterations."),
    ("whatif_numerics", "plots_numerics:draw_numerics",
     "What-if numerics over training (stored at capture): SQNR timeline per format, block-scale "
     "histograms, SQNR by phase and component."),
    ("run_timeline", "plots_timeline:draw_run_timeline",
     "The whole run from the flight recorder's summaries: absmax, flush and NaN/Inf per layer "
     "over every iteration, with its triggers."),
)
FULL_SECTIONS = tuple(name for name, _, _ in SECTION_TABLE)
#: section name -> the one-line description index.html shows
SECTION_DESCRIPTIONS: dict[str, str] = {name: text for name, _, text in SECTION_TABLE}


@dataclass
class Options:
    sample_size: int = 4096          # values kept per file read
    max_value_files: int = 256       # files read for value plots when stats are stored
    seed: int = 0
    workers: int = 2
    #: seconds one worker may spend on one file or one section before it is stopped (the
    #: file or section is then reported missing; the report goes on)
    worker_timeout: float = DEFAULT_TIMEOUT_S
    #: what-if formats beside those capture stored (None: capture's own, or DEFAULT_WHATIF when
    #: it stored none; (): none recomputed)
    whatif: tuple[str, ...] | None = None
    whatif_files: int = 256          # tensors given recomputed what-if numbers (one file each)
    max_pairs: int = 64
    map_stats: tuple[str, ...] = DEFAULT_MAP_STATS
    progress: bool = True
    dpi: int = 90
    index_dir: str | None = None     # where the columnar index goes (default: beside the capture)
    #: above this many manifest records the per-record figures draw from a selection of ranks
    #: and iterations (the header, outlier ranks and numerics.csv still cover every record)
    max_records: int = 50_000
    selection_records: int = 20_000
