"""Settings and names shared by the library and the command line (kept import-light, so
``--help`` answers without loading torch or matplotlib)."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_WHATIF = ("fp8_e4m3", "fp8_e5m2", "hifp8", "mxfp8", "mxfp6_e3m2", "mxfp4", "nvfp4", "bf16")
MAP_STAT_NAMES = ("absmax", "std", "overflow_ratio", "underflow_ratio", "flush_to_zero_ratio")
DEFAULT_MAP_STATS = ("absmax", "underflow_ratio", "overflow_ratio")

# The seeds' twelve draw/ folders (enhanced_tensor_analysis_summary.md), then ours.
SEED_SECTIONS = ("distributions", "heatmaps", "comparisons", "statistics", "attention_analysis",
                 "quantization_analysis", "layer_analysis", "overflow_analysis", "fp8_analysis",
                 "bf16_analysis", "backward_analysis", "rank_analysis")
ENHANCED_SECTIONS = SEED_SECTIONS + ("numerics_map",)
FULL_SECTIONS = ("distributions", "heatmaps", "comparisons", "statistics", "attention_analysis",
                 "attention_maps", "quantization_analysis", "layer_analysis", "overflow_analysis",
                 "fp8_analysis", "bf16_analysis", "backward_analysis", "rank_analysis", "numerics_map")


@dataclass
class Options:
    sample_size: int = 4096          # values kept per file read
    max_value_files: int = 256       # files read for value plots when stats are stored
    seed: int = 0
    workers: int = 2
    whatif: tuple[str, ...] = DEFAULT_WHATIF
    whatif_files: int = 48
    whatif_elems: int = 8192
    max_pairs: int = 64
    map_stats: tuple[str, ...] = DEFAULT_MAP_STATS
    progress: bool = True
    dpi: int = 90
