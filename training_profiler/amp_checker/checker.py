"""P0: static AMP checker. Parses Python files and bash launch scripts (never runs them) and
reports mixed-precision mistakes before a GPU hour is spent: AMP rules in Python
(training_profiler.amp_checker.rules), launch hazards in ``.sh`` files (training_profiler.amp_checker.launch_rules).

    python -m training_profiler.amp_checker.checker train.py src/ --format text --fail-on high

Exit codes: 0 no finding at/above --fail-on and every file parsed; 1 findings at/above it, or a
file that could not be parsed (reported, then skipped); 2 a usage error.
"""
from __future__ import annotations

import argparse
import ast
import io
import os
import re
import sys
import tokenize
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from lowp_common import CommandParser, UserError, cli_entry
from quant.vocabulary import Severity
from training_profiler.amp_checker.catalog import RULES, RULES_BY_ID, RULES_BY_NAME
from training_profiler.amp_checker.context import FileContext
from training_profiler.amp_checker.intent import BENCHMARK, INFERENCE, program_purpose
from training_profiler.amp_checker.launch_rules import (
    LAUNCH_RULES,
    LAUNCH_RULES_BY_ID,
    LAUNCH_RULES_BY_NAME,
    LaunchRule,
    NotBash,
    check_script,
)
from training_profiler.amp_checker.precision import in_model_library
from training_profiler.amp_checker.project import Project, module_names
from training_profiler.amp_checker.questions import deep_stack
from training_profiler.amp_checker.rules import Confidence, Finding, Rule
from training_profiler.findings_report import (
    CONFIDENCE_WORDS,
    FORMATTERS,
    SEVERITY_WORDS,
    FileError,
    Report,
    exit_code,
)

_SUPPRESS = re.compile(r"#\s*amp-check:\s*ignore(?:\[([^\]]*)\])?", re.I)
_SKIP_DIRS = {"__pycache__", ".git", ".venv", "venv", "node_modules", ".tox", "build", "dist"}


def default_confidence(project_mode: bool, model_library: bool = False) -> Confidence:
    """What is shown when --min-confidence is not given: every confidence for a single file or a
    folder of loose scripts (the file the user points at is the one they care about, even when
    no training is seen in it); HIGH only for a project (a package, or scripts importing each
    other) that trains, where the training is in the scan and a pattern it never reaches is
    noise; MEDIUM and up for a project in which nothing trains (a model library), whose
    precision is chosen by its users, outside the scan: MEDIUM's own definition."""
    if not project_mode:
        return Confidence.LOW
    return Confidence.MEDIUM if model_library else Confidence.HIGH


def apply_min_confidence(report: Report, minimum: Confidence | None,
                         per_path: Mapping[str, Confidence] | None = None) -> Report:
    """Keep the findings at or above ``minimum`` (None: the mode's default, per program when
    ``per_path`` gives a file's program default); count the rest."""
    report.min_confidence = default_confidence(report.project_mode, report.model_library) if minimum is None else minimum
    per_path = per_path if minimum is None and per_path else {}
    kept = [f for f in report.findings if f.confidence >= per_path.get(f.path, report.min_confidence)]
    report.hidden += len(report.findings) - len(kept)
    report.findings = kept
    return report


# what a training-path finding says in a file that trains nothing (intent.program_purpose)
PURPOSE_NOTES = {
    INFERENCE: " (this script takes no training step: no backward, optimizer or trainer; "
               "low confidence in inference, export and evaluation code)",
    BENCHMARK: " (this script only times its steps and saves nothing: a benchmark; low confidence)",
}

_ALL_RULES = RULES + LAUNCH_RULES
_ALL_BY_ID = {**RULES_BY_ID, **LAUNCH_RULES_BY_ID}
_ALL_BY_NAME = {**RULES_BY_NAME, **LAUNCH_RULES_BY_NAME}


def select_rules(select: Iterable[str] | None = None, ignore: Iterable[str] | None = None
                 ) -> list[Rule | LaunchRule]:
    """Rules chosen by id (AMP004, LCH002) or name (softmax-without-dtype); ValueError names a
    bad one. AMP rules apply to Python files, launch rules (LCH) to bash launch scripts."""
    def resolve(tokens: Iterable[str]) -> set[str]:
        out = set()
        for t in tokens:
            t = t.strip()
            if not t:
                continue
            rule = _ALL_BY_ID.get(t.upper()) or _ALL_BY_NAME.get(t.lower())
            if rule is None:
                raise ValueError(f"unknown rule {t!r}; known: {', '.join(r.id for r in _ALL_RULES)}")
            out.add(rule.id)
        return out

    every = {r.id for r in _ALL_RULES}
    chosen = resolve(select) or every if select else every
    dropped = resolve(ignore) if ignore else set()
    return [r for r in _ALL_RULES if r.id in chosen and r.id not in dropped]


def _suppressions(source: str) -> dict[int, set[str] | None]:
    """line -> suppressed rule ids (None = every rule) from `# amp-check: ignore[...]` comments."""
    out: dict[int, set[str] | None] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                m = _SUPPRESS.search(tok.string)
                if m:
                    ids = {x.strip().upper() for x in (m.group(1) or "").split(",") if x.strip()}
                    names = {RULES_BY_NAME[i.lower()].id for i in ids if i.lower() in RULES_BY_NAME}
                    out[tok.start[0]] = (ids | names) or None
    except (tokenize.TokenError, SyntaxError):
        pass
    return out


def _suppressed(sup: dict[int, set[str] | None], node: ast.AST, rule_id: str) -> bool:
    start = getattr(node, "lineno", 0)
    end = getattr(node, "end_lineno", start) or start
    for line in range(start, end + 1):
        if line in sup and (sup[line] is None or rule_id in sup[line]):
            return True
    return False


def parse_module(source: str, path: str, project: Project, name: str | None = None
                 ) -> FileContext | FileError:
    """One file parsed into the project (its facts are computed lazily, when a rule asks)."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        return FileError(path, exc.lineno or 0, f"syntax error: {exc.msg}")
    return FileContext(tree, project, name or Path(path).stem, path)


def run_rules(ctx: FileContext, source: str, rules: Sequence[Rule] | None = None) -> list[Finding]:
    """Findings for one parsed module, sorted by position, suppression comments applied."""
    sup = _suppressions(source)
    purpose = program_purpose(ctx)
    findings: list[Finding] = []
    seen: set[tuple[str, int, int]] = set()
    for rule in [r for r in (rules if rules is not None else RULES) if isinstance(r, Rule)]:
        for node, message, confidence in rule.visitor(ctx).run():
            key = (rule.id, node.lineno, node.col_offset)
            if key in seen or _suppressed(sup, node, rule.id):
                continue
            seen.add(key)
            if rule.training_path and purpose is not None and confidence > Confidence.LOW:
                confidence = Confidence.LOW
                message += PURPOSE_NOTES[purpose]
            findings.append(Finding(rule.id, rule.severity, ctx.path, node.lineno, node.col_offset + 1,
                                    message, rule.explanation, rule.suggestion, confidence))
    findings.sort(key=lambda f: (f.line, f.col, f.rule_id))
    return findings


def check_source(source: str, path: str = "<string>", rules: Sequence[Rule] | None = None,
                 min_confidence: Confidence = Confidence.LOW) -> tuple[list[Finding], FileError | None]:
    """Findings for one file's text on its own (a project of one module: every confidence by
    default); a syntax error comes back as FileError."""
    return deep_stack(_check_source, source, path, rules, min_confidence)


def _check_source(source: str, path: str, rules: Sequence[Rule] | None,
                  min_confidence: Confidence) -> tuple[list[Finding], FileError | None]:
    ctx = parse_module(source, path, Project())
    if isinstance(ctx, FileError):
        return [], ctx
    return [f for f in run_rules(ctx, source, rules) if f.confidence >= min_confidence], None


def iter_python_files(paths: Iterable[str | os.PathLike[str]]) -> Iterable[Path]:
    """Every .py and .sh file under the given files/folders, in a stable order."""
    for p in map(Path, paths):
        if p.is_dir():
            for sub in sorted([*p.rglob("*.py"), *p.rglob("*.sh")]):
                if not any(part in _SKIP_DIRS or part.startswith(".") for part in sub.relative_to(p).parts[:-1]):
                    yield sub
        elif p.is_file():
            yield p
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")


def check_paths(paths: Iterable[str | os.PathLike[str]], rules: Sequence[Rule] | None = None,
                context: Iterable[str | os.PathLike[str]] = (), min_confidence: Confidence | None = None
                ) -> Report:
    """Findings for every file under ``paths`` at or above ``min_confidence`` (None: every
    confidence for loose files, HIGH for a project, MEDIUM for a model library; see
    ``default_confidence``). All Python
    files of one call (and those under ``context``, which are read for what they set up but not
    reported) form one project: imports and calls between them are followed."""
    return deep_stack(_check_paths, paths, rules, context, min_confidence)


def _check_paths(paths: Iterable[str | os.PathLike[str]], rules: Sequence[Rule] | None,
                 context: Iterable[str | os.PathLike[str]], min_confidence: Confidence | None) -> Report:
    report = Report()
    rules = list(rules) if rules is not None else list(_ALL_RULES)
    paths, context = list(paths), list(context)
    project = Project(scan_roots=[*paths, *context])
    parsed: list[tuple[FileContext, str]] = []
    targets = list(iter_python_files(paths))
    wanted = {f.resolve() for f in targets}
    extra = [f for f in iter_python_files(context) if f.suffix == ".py" and f.resolve() not in wanted]
    names = module_names(f for f in targets + extra if f.suffix == ".py")
    for f in targets + extra:
        if f.suffix == ".sh":
            _check_launch(f, [r for r in rules if isinstance(r, LaunchRule)], report)
            continue
        reported = f.resolve() in wanted
        source_or_error = _read_python(f)
        if isinstance(source_or_error, FileError):
            if reported:
                report.errors.append(source_or_error)
            continue
        source = source_or_error
        ctx = parse_module(source, str(f), project, names[f])
        if isinstance(ctx, FileError):
            if reported:
                report.files_checked += 1
                report.errors.append(ctx)
            continue
        if reported:
            parsed.append((ctx, source))
    for ctx, source in parsed:
        report.files_checked += 1
        report.findings.extend(run_rules(ctx, source, rules))
    modes = program_modes(project, [c for c, _ in parsed])
    projects = [lib for mode, lib in modes.values() if mode]
    report.project_mode = bool(projects)
    report.model_library = bool(projects) and all(projects)
    per_path = {c.path: default_confidence(*modes[project.program_key(c)]) for c, _ in parsed}
    return apply_min_confidence(report, min_confidence, per_path)


def program_modes(project: Project, scanned: list[FileContext]) -> dict[Path | None, tuple[bool, bool]]:
    """Each program of the scan (``Project.program_key``) -> (a project, not loose scripts;
    a model library in which nothing trains): what its findings are shown at by default,
    decided for each repository of a scan apart, never by another's code."""
    groups: dict[Path | None, list[FileContext]] = {}
    for ctx in scanned:
        groups.setdefault(project.program_key(ctx), []).append(ctx)
    out = {}
    for key, members in groups.items():
        mode = project.is_one_program(members)
        out[key] = (mode, mode and in_model_library(members[0]))
    return out


def _read_python(f: Path) -> str | FileError:
    """A Python file's text (its coding cookie honoured), or one line saying why not: unreadable,
    binary, or not in its declared encoding."""
    try:
        data = f.read_bytes()
    except OSError as exc:
        return FileError(str(f), 0, f"cannot read: {exc.strerror or exc}")
    if b"\0" in data:
        return FileError(str(f), 0, "a binary file, not Python source")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, LookupError) as exc:
        why = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        return FileError(str(f), 0, f"not UTF-8 text ({why}); re-save it as UTF-8 or add a coding line")
    except UnicodeDecodeError as exc:
        return FileError(str(f), 0, f"not {exc.encoding} text (byte {exc.start}); add a coding line or fix the file")


def _check_launch(f: Path, rules: list[LaunchRule], report: Report) -> None:
    """A bash launch script through the launch rules; unreadable, binary, non-UTF-8 or
    not-bash files are one error each and the scan goes on."""
    try:
        data = f.read_bytes()
    except OSError as exc:
        report.errors.append(FileError(str(f), 0, f"cannot read: {exc.strerror or exc}"))
        return
    if b"\0" in data:
        report.errors.append(FileError(str(f), 0, "a binary file, not a launch script"))
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        report.errors.append(FileError(str(f), 0, f"not UTF-8 text (byte {exc.start})"))
        return
    try:
        report.findings.extend(check_script(text, str(f), rules))
    except NotBash as exc:
        report.errors.append(FileError(str(f), 1, str(exc)))
        return
    report.files_checked += 1


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="amp-static-check",
        description="Static checker for PyTorch automatic-mixed-precision mistakes (never runs the code).",
        epilog="Rules: " + "; ".join(f"{r.id} {r.name} [{r.severity.name}]" for r in _ALL_RULES)
        + ". Suppress one line with `# amp-check: ignore[AMP001]` (or `# amp-check: ignore`).")
    p.add_argument("paths", nargs="+", help="Python files, bash launch scripts (.sh: the LCH "
                   "rules) or folders to scan")
    p.add_argument("--context", action="append", default=[], metavar="DIR",
                   help="a folder read for what it sets up (GradScalers, autocast helpers, losses) "
                   "but not reported; repeatable. Folders given as PATHS are already one project")
    p.add_argument("--format", choices=sorted(FORMATTERS), default="text", help="output format (default text)")
    p.add_argument("--select", default="", help="comma-separated rule ids or names to run (default all)")
    p.add_argument("--ignore", default="", help="comma-separated rule ids or names to skip")
    p.add_argument("--fail-on", default="high", choices=SEVERITY_WORDS,
                   help="exit 1 when a finding at or above this severity exists (default high)")
    p.add_argument("--min-confidence", default=None, choices=CONFIDENCE_WORDS,
                   help="show findings at or above this confidence: high = the training is seen, "
                   "medium = the precision is decided outside the scan, low = no training seen "
                   "(default: low for one file or a folder of loose scripts, high for a project that "
                   "trains, medium for a model library in which nothing trains)")
    p.add_argument("--audit", metavar="SCRIPT", default=None,
                   help="also run SCRIPT for 2 optimizer steps under the run-time precision audit "
                   "(lowp-audit) and merge its findings (what ran in which dtype, which no source shows)")
    p.add_argument("--list-rules", action="store_true", help="print the rules and exit")
    return p


@cli_entry("amp-static-check")
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--list-rules" in argv:
        for r in _ALL_RULES:
            print(f"{r.id}  {r.name:34s} {r.severity.name:6s} {r.explanation}")
        return 0
    args = build_parser().parse_args(argv)
    try:
        rules = select_rules(args.select.split(","), args.ignore.split(","))
        minimum = Confidence.parse(args.min_confidence) if args.min_confidence else None
        report = check_paths(args.paths, rules, context=args.context, min_confidence=minimum)
        if args.audit:  # run-time findings merged in the same report (training_profiler.audit)
            from training_profiler.audit.cli import merge_audit
            report.errors += merge_audit(report, args.audit)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    text = FORMATTERS[args.format](report)
    if text:
        print(text)
    for e in report.errors:
        print(f"amp-static-check: skipped {e.path}: line {e.line}: {e.message}", file=sys.stderr)
    return exit_code(report, Severity.parse(args.fail_on))


if __name__ == "__main__":
    sys.exit(main())
