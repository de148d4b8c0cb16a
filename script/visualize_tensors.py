#!/usr/bin/env python
"""Full visualization (every folder, quick view, index.html) of a captured-tensor directory.

Thin wrapper over ``tensor_viz.full`` so it runs from a checkout without installing:
``python script/visualize_tensors.py --tensor_dir ./tensor_logs --output_dir ./draw`` (see --help).
"""
import os
import sys

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))

from tensor_viz.full import main

if __name__ == "__main__":
    sys.exit(main())
