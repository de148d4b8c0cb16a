"""quant_tools: the command-line applications over the numerics core ``quant``.

``scaling_cli`` (``mxfp-scaling-test``: input files, logs, results file, figures, JSON),
``scaling_report`` (the sweep's text report) and ``demo`` (``quant-demo``). ``quant`` itself
imports nothing of this package (docs/architecture.md).
"""
