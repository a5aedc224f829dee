"""The ``hpdl`` command: one argparse tree whose subcommands live beside the code they run.

Each subcommand module exposes ``register(subparsers)``; its handler is stored as the parser's
``func`` default and receives the parsed namespace. Modules import torch lazily, inside their
handlers, so ``hpdl --help`` and ``hpdl run --dry-run`` stay fast.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from typing import IO, Any, Callable, NoReturn, Optional, Sequence

from hpdl import __version__
from hpdl.atomic_file import file_in_the_way, not_a_directory
from hpdl.config import SettingsError


class CliError(Exception):
    """An error to report at the command line as one line, with exit status ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def check_output(option: str, path: str, inputs: Sequence[str] = (), overwrite: bool = False) -> None:
    """Refuse, before any work, an output file that a command could not or must not write.

    The rules every command that writes a named file keeps (``hpdl sr`` has its own, alike):
    its directory must exist (nothing is created), the file must not be a directory, nor any
    of ``inputs`` under another name (a link, a ``..``), nor, without ``overwrite``, any other
    existing file. ``option`` names where the path came from (``--html``) in the error.

    Raises:
        CliError: naming the option, the path and the reason.
    """
    where = f"{option} {path}"
    directory = os.path.dirname(os.path.abspath(path))
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise CliError(f"{option}: cannot write {path}: {not_a_directory(blocker)}")
    if not os.path.isdir(directory):
        raise CliError(f"{option}: cannot write {path}: its directory does not exist")
    if os.path.isdir(path):
        raise CliError(f"{option}: cannot write {path}: is a directory; name a file")
    try:
        written = os.stat(path)
    except OSError:
        written = None
    for source in inputs:
        try:
            read = os.stat(source)
        except OSError:  # a missing input is reported when it is read
            continue
        # Device and inode: the same file however it is spelt (a link, another path, a hard link).
        if written is not None and (written.st_dev, written.st_ino) == (read.st_dev, read.st_ino):
            raise CliError(f"{where}: is the input {source}; write to another file")
    if not overwrite and os.path.lexists(path):
        raise CliError(f"{where}: already exists; pass --overwrite to replace it")


def write_output(path: str, write: Callable[[IO], None], binary: bool = False,
                 check: Optional[Callable[[], None]] = None) -> None:
    """Call ``write(f)`` on a temp file beside ``path``, then rename it over ``path``
    (:func:`hpdl.atomic_file.atomic_write`; ``binary=False`` gives ``write`` a UTF-8 text stream).

    Readers see the old file or the whole new one, and a failure leaves neither a partial file
    nor the temp file. ``check`` runs again right before the rename, so that a file made
    meanwhile where ``path`` points is not replaced against :func:`check_output`'s rules.

    Raises:
        CliError: naming ``path`` when the file system refuses it.
    """
    from hpdl.atomic_file import atomic_write

    def write_stream(f) -> None:
        if binary:
            write(f)
            return
        text = io.TextIOWrapper(f, encoding="utf-8")
        write(text)
        text.detach().flush()  # leave the binary stream open: atomic_write closes it

    try:
        atomic_write(path, write_stream, check_target=(lambda _target: check()) if check is not None else None)
    except OSError as err:
        if err.errno is None:
            raise
        raise CliError(f"cannot write {path}: {err.strerror or err}") from None


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
