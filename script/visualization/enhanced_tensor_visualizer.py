#!/usr/bin/env python
"""Enhanced analysis (the twelve draw/ folders, numerics map, index.html) of a captured-tensor directory.

Thin wrapper over ``tensor_viz.analysis_cli`` so it runs from a checkout without installing:
``python script/visualization/enhanced_tensor_visualizer.py --tensor_dir ./tensor_logs --output_dir ./draw`` (see --help).
"""
import os
import sys

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "../..")))

from tensor_viz.analysis_cli import main

if __name__ == "__main__":
    sys.exit(main())
