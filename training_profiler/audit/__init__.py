"""Run-time precision audit: run a few training steps under a recorder and judge what ran.

    @audit_precision(steps=2)          # the first two calls are audited, later ones run bare
    def train_step(batch): ...

    with precision_audit() as audit:   # any block
        train_step(batch)
    print(audit.findings)

    run_script("train.py", ["--lr", "1e-3"], steps=2)   # lowp-audit's library function

The source states dtypes only where it casts; what a tensor is at run time (bf16 logits reaching
``log_softmax`` through a wrapper, a reduction accumulating in float16, an Adam eps below a float16
step) is visible only while it runs. The recorder (:mod:`training_profiler.audit.record`) notes
each op's dtypes and range per call site; the rules (:mod:`training_profiler.audit.rules`) turn
that into findings in the static checker's format. The audit never changes a value and leaves
nothing installed after its steps.
"""
from __future__ import annotations

import functools
import os
import runpy
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TextIO

from training_profiler.audit.record import OpRecorder, Record, StopAudit
from training_profiler.audit.rules import judge
from training_profiler.findings_report import Finding


class PrecisionAudit:
    """A context manager recording every op run inside it; ``findings`` once it exits. It may be
    entered again (the decorator does, once per audited call): the record accumulates."""

    def __init__(self, max_steps: int | None = None) -> None:
        self.recorder = OpRecorder(max_steps)
        self.findings: list[Finding] = []

    @property
    def record(self) -> Record:
        return self.recorder.record

    def __enter__(self) -> PrecisionAudit:
        self.recorder.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.recorder.__exit__(*exc)
        self.findings = judge(self.recorder.record)
        return False


def precision_audit(max_steps: int | None = None) -> PrecisionAudit:
    """``with precision_audit() as audit: ...``; ``audit.findings`` after the block."""
    return PrecisionAudit(max_steps)


def format_findings(findings: Sequence[Finding], fmt: str = "text", files_checked: int = 1) -> str:
    """The static checker's text / line / json output of run-time findings (``files_checked``:
    the scripts audited, for its summary line)."""
    from training_profiler.findings_report import FORMATTERS, Report

    return FORMATTERS[fmt](Report(findings=list(findings), files_checked=files_checked))


_STDERR: Any = object()   # the decorator's default stream: sys.stderr as it is when it prints


def audit_precision(fn: Callable | None = None, *, steps: int = 2,
                    report: TextIO | None = _STDERR) -> Callable:
    """Decorator: audit the first ``steps`` calls of a training-step function, then print the
    findings to ``report`` (default stderr; None: print nothing) and run later calls without
    any recorder.
    The wrapped function's ``.audit`` holds the :class:`PrecisionAudit` (``.audit.findings``)."""
    if steps < 1:
        raise ValueError(f"audit_precision: steps must be >= 1, got {steps}")

    def decorate(step_fn: Callable) -> Callable:
        audit = PrecisionAudit()
        calls = [0]

        @functools.wraps(step_fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if calls[0] >= steps:
                return step_fn(*args, **kwargs)
            calls[0] += 1
            with audit:
                out = step_fn(*args, **kwargs)
            if calls[0] == steps and report is not None:
                print(format_findings(audit.findings), file=sys.stderr if report is _STDERR else report)
            return out

        wrapper.audit = audit
        return wrapper

    return decorate(fn) if fn is not None else decorate


@dataclass
class ScriptOutcome:
    """What running a script under the audit gave: its findings, how many optimizer steps (and
    iterations of hand-written parameter updates) were audited, and its traceback when the
    script failed on its own."""

    findings: list[Finding] = field(default_factory=list)
    steps: int = 0
    error: str | None = None


def run_script(script: str, args: Sequence[str] = (), steps: int = 2, module: bool = False
               ) -> ScriptOutcome:
    """Run ``script`` (a module name with ``module=True``, as ``python -m``) as ``__main__`` in
    this process with ``sys.argv = [script, *args]``, under the audit, stopping after ``steps``
    optimizer steps, GradScaler iterations or iterations of hand-written parameter updates (a
    script with none of them runs to its end). ``sys.argv``, ``sys.path``
    and the environment are restored afterwards. Ctrl-C propagates; any other failure of the
    script is returned as its traceback."""
    audit = PrecisionAudit(max_steps=steps)
    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    sys.argv = [script, *args]
    sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(script)))
    error = None
    try:
        with audit:
            if module:
                runpy.run_module(script, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
    except StopAudit:
        pass
    except SystemExit as exc:
        if exc.code not in (0, None):
            error = traceback.format_exc()
    except KeyboardInterrupt:
        raise
    except BaseException:  # the user's script failed on its own: reported, not ours to raise
        error = traceback.format_exc()
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if dict(os.environ) != saved_env:  # e.g. MASTER_PORT of a process group it started
            os.environ.clear()
            os.environ.update(saved_env)
    return ScriptOutcome(audit.findings, len(audit.record.steps) + audit.record.manual_iterations, error)
