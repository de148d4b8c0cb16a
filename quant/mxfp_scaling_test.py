"""The original script path of ``mxfp-scaling-test``: runs ``quant_tools.scaling_cli.main``.

``python quant/mxfp_scaling_test.py T.pt ...`` from the repository root. Run as a file, Python
puts quant/ first on sys.path (its modules would shadow top-level names): the repository root
goes there instead. See docs/scaling.md.
"""
import os
import sys

if __package__ in (None, ""):
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from quant_tools.scaling_cli import main

if __name__ == "__main__":
    sys.exit(main())
