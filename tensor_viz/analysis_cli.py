"""enhanced-tensor-visualizer (first written as script/visualization/enhanced_tensor_visualizer.py):
that script's twelve draw/ folders plus the numerics map, and index.html."""
from __future__ import annotations

import sys

from tensor_viz import cli
from tensor_viz import options as sections


def main(argv: list[str] | None = None) -> int:
    return cli.run(argv, prog="enhanced-tensor-visualizer", sections=sections.ENHANCED_SECTIONS, quick=False,
                   report=True,
                   description="Enhanced analysis of a captured-tensor directory: distributions, heatmaps, "
                               "comparisons, statistics, attention, quantization, layer, overflow, FP8, BF16, "
                               "backward and rank analysis, a numerics map, and index.html.")


if __name__ == "__main__":
    sys.exit(main())
