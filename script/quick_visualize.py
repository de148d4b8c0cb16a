#!/usr/bin/env python
"""Quick view (quick_analysis.png, tensor_stats.txt) of a captured-tensor directory.

Thin wrapper over ``tensor_viz.quick`` so it runs from a checkout without installing:
``python script/quick_visualize.py --tensor_dir ./tensor_logs --output_dir ./draw`` (see --help).
"""
import os
import sys

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))

from tensor_viz.quick_cli import main

if __name__ == "__main__":
    sys.exit(main())
