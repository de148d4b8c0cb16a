"""A finding, its levels, the report and its output formats (text, line, json, the exit code):
what ``amp-static-check`` (training_profiler.amp_checker) prints and what the run-time audit
(training_profiler.audit) prints its findings in, so both speak one format and the audit never
imports the checker.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import IntEnum

from quant.vocabulary import FINDING_LEVELS, Severity


class Confidence(IntEnum):
    """How sure the checker is that a finding's pattern is live in mixed-precision training:
    HIGH, the training (autocast, a scaler, a low-precision model that an optimizer steps) is
    seen; MEDIUM, the precision is decided outside the scan (a library, a launcher's config);
    LOW, no training is seen at all: the documented pattern only, reported in case it runs
    under AMP."""
    LOW = 1
    MEDIUM = 2
    HIGH = 3

    @classmethod
    def parse(cls, text: str) -> "Confidence":
        """A confidence from a command line (low / medium / high); ValueError otherwise."""
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"unknown confidence {text!r}; use low, medium or high") from None


#: the words a command line takes for a finding's severity or confidence, mildest first
SEVERITY_WORDS = tuple(s.word for s in FINDING_LEVELS)
CONFIDENCE_WORDS = tuple(c.name.lower() for c in Confidence)


@dataclass(frozen=True)
class Finding:
    rule_id: str
    severity: Severity
    path: str
    line: int
    col: int
    message: str
    explanation: str
    suggestion: str
    confidence: Confidence = Confidence.HIGH

    def to_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "col": self.col, "rule": self.rule_id,
                "severity": self.severity.name, "confidence": self.confidence.name.lower(),
                "message": self.message, "explanation": self.explanation, "suggestion": self.suggestion}


@dataclass
class FileError:
    path: str
    line: int
    message: str

    def to_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "error": self.message}


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    errors: list[FileError] = field(default_factory=list)
    files_checked: int = 0
    project_mode: bool = False
    model_library: bool = False  # a project in which nothing trains
    min_confidence: Confidence = Confidence.LOW
    hidden: int = 0  # findings below min_confidence


def format_text(report: Report) -> str:
    lines: list[str] = []
    by_file: dict[str, list] = {}
    for f in report.findings:
        by_file.setdefault(f.path, []).append(f)
    for e in report.errors:
        by_file.setdefault(e.path, []).append(e)
    for path, items in by_file.items():
        lines.append(f"File: {path}")
        for it in sorted(items, key=lambda x: x.line):
            if isinstance(it, FileError):
                lines.append(f"Line {it.line}: [SKIPPED] {it.message}")
            else:
                conf = "" if it.confidence == Confidence.HIGH else f" ({it.confidence.name.lower()} confidence)"
                lines.append(f"Line {it.line}: [{it.severity.name}] {it.rule_id} {it.message}{conf}")
                lines.append(f"  -> {it.explanation}")
                lines.append(f"  -> Suggestion: {it.suggestion}")
            lines.append("")
    counts = {s.name: sum(1 for f in report.findings if f.severity == s) for s in FINDING_LEVELS}
    lines.append(f"{report.files_checked} file(s) checked, {len(report.findings)} finding(s) "
                 f"(HIGH {counts['HIGH']}, MEDIUM {counts['MEDIUM']}, LOW {counts['LOW']}), "
                 f"{len(report.errors)} file(s) skipped")
    if report.hidden:
        lines.append(f"{report.hidden} finding(s) below {report.min_confidence.name.lower()} confidence "
                     "not shown (--min-confidence low shows them)")
    return "\n".join(lines)


def format_line(report: Report) -> str:
    out = [f"{f.path}:{f.line}:{f.col}: {f.rule_id} {f.message}"
           + ("" if f.confidence == Confidence.HIGH else f" [{f.confidence.name.lower()} confidence]")
           for f in report.findings]
    out += [f"{e.path}:{e.line}:0: E999 {e.message}" for e in report.errors]
    return "\n".join(out)


def format_json(report: Report) -> str:
    return json.dumps({"files_checked": report.files_checked, "project_mode": report.project_mode,
                       "model_library": report.model_library,
                       "min_confidence": report.min_confidence.name.lower(), "hidden": report.hidden,
                       "findings": [f.to_dict() for f in report.findings],
                       "errors": [e.to_dict() for e in report.errors]}, indent=2)


FORMATTERS = {"text": format_text, "line": format_line, "json": format_json}


def exit_code(report: Report, fail_on: Severity) -> int:
    if report.errors or any(f.severity >= fail_on for f in report.findings):
        return 1
    return 0
