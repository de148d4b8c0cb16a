"""User-facing errors: one clear line and a non-zero exit, never a traceback for a user mistake.

The one definition lives in ``lowp_common.cli``; this module keeps training_driver's imports
(``from .errors import UserError, cli_entry``) short.
"""
from lowp_common.cli import EXIT_INTERRUPTED, EXIT_USER_ERROR, CommandParser, UserError, cli_entry

__all__ = ["EXIT_INTERRUPTED", "EXIT_USER_ERROR", "CommandParser", "UserError", "cli_entry"]
