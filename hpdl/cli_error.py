"""The error a command reports as one line, ``hpdl: error: <message>``, with its exit status.

The subcommands' handlers raise it (bench/, launch/, profile/ and sr/ each have theirs) and
``hpdl/cli.py`` prints it. It lives below every layer so that those handlers need not import the
command line, which imports them.
"""

from __future__ import annotations

__all__ = ["CliError"]


class CliError(Exception):
    """An error to report at the command line as one line, with exit status ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
