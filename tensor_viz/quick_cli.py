"""quick-visualize (first written as script/quick_visualize.py): quick_analysis.png + tensor_stats.txt.

The command lives apart from the quick-view library (tensor_viz.quick), which the full report
also draws through, so the library never imports the command layer.
"""
from __future__ import annotations

import sys

from tensor_viz import cli


def main(argv: list[str] | None = None) -> int:
    """quick-visualize: quick_analysis.png + tensor_stats.txt."""
    return cli.run(argv, prog="quick-visualize", sections=(), quick=True, report=False,
                   description="Quick view of a captured-tensor directory: quick_analysis.png "
                               "(value histogram, pies by quant type, layer type, pass) and tensor_stats.txt.")


if __name__ == "__main__":
    sys.exit(main())
