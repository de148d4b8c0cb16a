"""Plots and reports for captured tensors (the files tensor_capture writes).

Modules: ``catalog`` (find tensors and bad input), ``values`` (read values, one file
at a time, across processes), ``stats`` (statistics when the capture did not store
them), ``figures`` (saving, placeholders), ``plots_*`` (one job per draw/ folder),
``report`` (index.html), ``pipeline`` (build everything), and the command-line
front ends ``quick``, ``full``, ``analysis_cli``.
"""
