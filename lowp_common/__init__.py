"""Bottom-layer helpers every console command shares; imports nothing of the project.

``lowp_common.cli``: a user mistake becomes one line on stderr and exit 2 (Ctrl-C exits 130),
files are written under a temporary name and renamed so a crash never leaves half a file, and
numbers are made JSON-safe (NaN/Inf, numpy and torch scalars) in one place; every parser is a
``CommandParser`` (no abbreviated options, a mistake in one line). ``lowp_common.outputs``: a
result written earlier is never replaced without ``--force``.
"""
from lowp_common.cli import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    CommandParser,
    HelpWithDefaults,
    UsageError,
    UserError,
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    cli_entry,
    fail,
    human_bytes,
    json_dumps,
    json_safe,
    quiet_closed_stdout,
    staged_dir,
)
from lowp_common.outputs import check_writable, claim_folder, mark_folder, refuse_overwrite

__all__ = [
    "EXIT_INTERRUPTED", "EXIT_USER_ERROR", "CommandParser", "HelpWithDefaults", "UsageError",
    "UserError", "atomic_path", "atomic_write_bytes", "atomic_write_json", "atomic_write_text",
    "check_writable", "claim_folder", "cli_entry", "fail", "human_bytes", "json_dumps",
    "json_safe", "mark_folder", "quiet_closed_stdout", "refuse_overwrite", "staged_dir",
]
