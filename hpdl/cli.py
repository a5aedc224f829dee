"""The ``hpdl`` command: one argparse tree whose subcommands live beside the code they run.

Each subcommand module exposes ``register(subparsers)``; its handler is stored as the parser's
``func`` default and receives the parsed namespace. Modules import torch lazily, inside their
handlers, so ``hpdl --help`` and ``hpdl run --dry-run`` stay fast. A handler's error (a
``CliError``, an output file ``hpdl.output_files`` refuses, a bad ``HPDL_*`` setting) becomes
one line here.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn, Optional, Sequence

from hpdl import __version__
from hpdl.cli_error import CliError
from hpdl.config import SettingsError
from hpdl.output_files import OutputError


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, like every other hpdl error.

    Subcommand parsers are made of the same class, so an invalid value anywhere in the tree
    (``--iterations abc``, a missing option value) ends in ``hpdl: error: ...`` and exit 2.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"hpdl: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> argparse.Namespace:
        # Options no parser knew reach the top parser; the help that lists the right ones is
        # the subcommand's (`hpdl run --help`), which the deepest parser's default names.
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            prog = getattr(parsed, _HELP_PROG, self.prog)
            self.exit(2, f"hpdl: error: unrecognized arguments: {' '.join(unknown)} (see {prog} --help)\n")
        return parsed


_HELP_PROG = "_hpdl_help_prog"


def _name_help(parser: argparse.ArgumentParser) -> None:
    """Give every parser of the tree a default naming itself; the deepest one used wins."""
    parser.set_defaults(**{_HELP_PROG: parser.prog})
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _name_help(child)


def build_parser() -> argparse.ArgumentParser:
    """Build the full ``hpdl`` argument parser."""
    from hpdl.bench import cli as bench_cli
    from hpdl.launch import cli as launch_cli
    from hpdl.launch import emulate
    from hpdl.profile import cli as profile_cli
    from hpdl.sr import cli as sr_cli

    parser = _Parser(
        prog="hpdl",
        description="Data-parallel training for PyTorch across processes and machines: "
        "launch jobs, check the installation, benchmark, profile communication, and train "
        "super-resolution models.",
    )
    parser.add_argument("--version", action="version", version=f"hpdl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    launch_cli.register(sub)
    emulate.register(sub)
    bench_cli.register(sub)
    sr_cli.register(sub)
    profile_cli.register(sub)
    _name_help(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``hpdl`` command line; return the exit status."""
    try:
        try:
            return _run(argv)
        finally:
            # Flushed here, also before argparse's exit after --help, so that a reader that
            # went away is seen here rather than in the interpreter's last flush.
            sys.stdout.flush()
    except BrokenPipeError:
        return _reader_gone()


def _run(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except CliError as err:
        return _error(str(err), err.code)
    except OutputError as err:  # an output file refused (hpdl/output_files.py)
        return _error(str(err), 2)
    except SettingsError as err:  # an HPDL_* variable, read where the runtime starts
        return _error(str(err), 2)
    except KeyboardInterrupt:
        print("hpdl: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


def _reader_gone() -> int:
    """The reader of stdout went away (``hpdl ... | head``): end quietly, as a shell tool does.

    Python's recipe: point stdout at devnull, so that the interpreter's final flush of what
    is still buffered does not fail again; the status is a SIGPIPE death's, 128 + 13.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


def _error(message: str, code: int) -> int:
    """Print ``message`` as the one error line (on rank 0 only, when run as ranks of a job)."""
    from hpdl.comm.topology import discover_topology

    try:
        reporting = discover_topology().rank == 0
    except ValueError:  # the launcher's variables themselves are unreadable: say it anyway
        reporting = True
    if reporting:
        print(f"hpdl: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
