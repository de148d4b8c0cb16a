"""Severity of a ratio of affected elements (overflow, flush to zero): the one definition.

Why its own module: the analysis (torch) and the diagnosis (SQL over the index, no torch) judge
the same ratios against the same thresholds; this module imports nothing, so both read it.
"""
from __future__ import annotations

#: a ratio above this is "high" (1 % of the elements), above MEDIUM_THRESHOLD "medium"
HIGH_THRESHOLD = 0.01
MEDIUM_THRESHOLD = 0.001

#: the severity names, mildest first (every tool's one spelling; reports print
#: :func:`severity_label`)
SEVERITY_NONE, SEVERITY_MEDIUM, SEVERITY_HIGH = SEVERITIES = ("none", "medium", "high")


def severity(ratio: float) -> str:
    """'high' above 1 %, 'medium' above 0.1 %, else 'none'."""
    if ratio > HIGH_THRESHOLD:
        return SEVERITY_HIGH
    if ratio > MEDIUM_THRESHOLD:
        return SEVERITY_MEDIUM
    return SEVERITY_NONE


def severity_label(name: str) -> str:
    """A severity as reports print it ("NONE", "MEDIUM", "HIGH"; the sweep's levels hold it)."""
    return name.upper()
