"""visualize-tensors (first written as script/visualize_tensors.py): every figure, the quick view and index.html."""
from __future__ import annotations

import sys

from tensor_viz import cli
from tensor_viz import options as sections


def main(argv: list[str] | None = None) -> int:
    return cli.run(argv, prog="visualize-tensors", sections=sections.FULL_SECTIONS, quick=True, report=True,
                   description="Full visualization of a captured-tensor directory: every draw/ folder, "
                               "quick_analysis.png, tensor_stats.txt and a static index.html report.")


if __name__ == "__main__":
    sys.exit(main())
