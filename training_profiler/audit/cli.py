"""``lowp-audit``: run a training script for a few optimizer steps under the run-time precision
audit and print its findings in the static checker's format.

    lowp-audit train.py -- --lr 1e-3 --batch 8
    lowp-audit train.py --steps 3 --format json --json audit.json
    lowp-audit -m training_driver.train -- --data-path ... --tokenizer ... --model tiny

The script runs in this process (``runpy``, ``__name__ == "__main__"``, ``sys.argv`` set to the
script and the arguments after ``--``) and is stopped after ``--steps`` optimizer steps. Exit
codes: 0 no finding at or above ``--fail-on``; 1 findings at or above it, or the script failed on
its own (its traceback is written to a new file, named on stderr); 2 a usage error.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from typing import Sequence

from lowp_common import (
    CommandParser,
    UserError,
    atomic_write_text,
    check_writable,
    cli_entry,
    refuse_overwrite,
)
from quant.vocabulary import Severity
from training_profiler.audit import ScriptOutcome, format_findings, run_script
from training_profiler.audit.rules import RULES
from training_profiler.findings_report import SEVERITY_WORDS

PROG = "lowp-audit"


def check_script(script: str, flag: str = "script") -> None:
    """UserError when ``script`` is missing or not Python (compiled, never run, to tell)."""
    if not os.path.isfile(script):
        raise UserError(f"{flag} {script}: no such file; give the training script to audit")
    try:
        with open(script, "rb") as fh:
            compile(fh.read(), script, "exec")
    except (SyntaxError, ValueError) as exc:
        raise UserError(f"{flag} {script}: not a Python script ({exc.__class__.__name__}: "
                        f"{getattr(exc, 'msg', exc)}); give the training script to audit") from None


def write_traceback(outcome: ScriptOutcome) -> str:
    """The script's traceback in a new file (never one written earlier); returns its path."""
    fd, path = tempfile.mkstemp(prefix="lowp-audit-", suffix=".traceback.txt")
    os.close(fd)
    atomic_write_text(path, outcome.error or "")
    return path


def check_module(name: str) -> None:
    """UserError when module ``name`` cannot be found (found, never imported)."""
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(f"-m {name}: no such module; give an importable module (as python -m)")


def audit_script(script: str, args: Sequence[str] = (), steps: int = 2, prog: str = PROG,
                 module: bool = False) -> tuple[ScriptOutcome, int]:
    """Check and run ``script`` (a module name with ``module=True``) under the audit; a failure
    of the script itself is told on stderr with its traceback file. Returns the outcome and 1
    when the script failed, else 0."""
    (check_module if module else check_script)(script)
    outcome = run_script(script, args, steps, module=module)
    if outcome.error is None:
        return outcome, 0
    last = outcome.error.strip().splitlines()[-1]
    print(f"{prog}: script failed: {script} ({last}); its traceback: {write_traceback(outcome)}",
          file=sys.stderr)
    return outcome, 1


def merge_audit(report, script: str, steps: int = 2) -> list:
    """``amp-static-check --audit SCRIPT``: run SCRIPT under the audit and add its findings to
    the static checker's ``report``; returns the static checker's ``FileError`` for a script
    that failed on its own (so the command exits 1), else nothing."""
    from training_profiler.findings_report import FileError

    outcome, failed = audit_script(script, (), steps, prog="amp-static-check")
    report.findings.extend(outcome.findings)
    report.files_checked += 1
    return [FileError(script, 0, "the audited script failed (traceback file named on stderr)")] if failed else []


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog=PROG,
        description="Run a training script for a few optimizer steps under the run-time precision "
        "audit (dtypes and ranges of every op, per call site) and report the precision hazards seen.",
        epilog="Rules: " + "; ".join(f"{r.id} {r.name} [{r.severity.name}]" for r in RULES)
        + ". Arguments after -- go to the script.")
    p.add_argument("script", nargs="?", default=None,
                   help="the training script (run in this process as __main__)")
    p.add_argument("-m", "--module", default=None, metavar="MODULE",
                   help="run a module instead of a script, as python -m (e.g. training_driver.train)")
    p.add_argument("--steps", type=int, default=2,
                   help="optimizer steps (or GradScaler iterations, skipped ones included) to audit "
                   "before the script is stopped (default 2)")
    p.add_argument("--format", choices=("text", "line", "json"), default="text",
                   help="output format on stdout (default text, as amp-static-check)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the findings as JSON")
    p.add_argument("--force", action="store_true", help="replace a --json file written earlier")
    p.add_argument("--fail-on", default="high", choices=SEVERITY_WORDS,
                   help="exit 1 when a finding at or above this severity exists (default high)")
    return p


@cli_entry(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:split])
    if (args.script is None) == (args.module is None):
        raise UserError("give a training script or -m MODULE (one of them)")
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: give a number of optimizer steps >= 1")
    if args.json:
        check_writable(args.json, "--json")
        refuse_overwrite([args.json], what="an audit's findings", force=args.force)
    outcome, failed = audit_script(args.script or args.module, argv[split + 1:], args.steps,
                                   module=args.module is not None)
    text = format_findings(outcome.findings, args.format)
    if text:
        print(text)
    if args.json:
        atomic_write_text(args.json, format_findings(outcome.findings, "json") + "\n")
    fail_on = Severity.parse(args.fail_on)
    return 1 if failed or any(f.severity >= fail_on for f in outcome.findings) else 0


if __name__ == "__main__":
    sys.exit(main())
