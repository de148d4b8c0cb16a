"""Severity of a ratio of affected elements (overflow, flush to zero): the one definition.

Why its own module: the analysis (torch) and the diagnosis (SQL over the index, no torch) judge
the same ratios against the same thresholds; this module imports no torch, so both read it. The
levels themselves are ``quant.vocabulary.Severity``'s (the one ordered scale).
"""
from __future__ import annotations

from .vocabulary import Severity

#: a ratio above this is "high" (1 % of the elements), above MEDIUM_THRESHOLD "medium"
HIGH_THRESHOLD = 0.01
MEDIUM_THRESHOLD = 0.001

#: a ratio's severity words, mildest first (Severity's words; reports print
#: :func:`severity_label`)
SEVERITY_NONE, SEVERITY_MEDIUM, SEVERITY_HIGH = SEVERITIES = tuple(
    s.word for s in (Severity.NONE, Severity.MEDIUM, Severity.HIGH))


def severity(ratio: float) -> str:
    """'high' above 1 %, 'medium' above 0.1 %, else 'none'."""
    if ratio > HIGH_THRESHOLD:
        return SEVERITY_HIGH
    if ratio > MEDIUM_THRESHOLD:
        return SEVERITY_MEDIUM
    return SEVERITY_NONE


def severity_label(name: str) -> str:
    """A severity as reports print it ("NONE", "MEDIUM", "HIGH"; the sweep's levels hold it)."""
    return Severity.of(name).label
