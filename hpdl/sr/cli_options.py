"""What the ``hpdl sr`` commands share: their common options, the checks they run before any
work, and the wrapper that turns hpdl.sr's errors into the command line's one line. cli.py and
upscale_cli.py both import it; it imports neither."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from typing import Any, Callable

from hpdl.cli_error import CliError
from hpdl.sr.config import DEFAULT_MAX_PIXELS

__all__ = ["warnings_in_one_line", "SR_EXTRA", "require_sr_extra", "add_max_pixels", "add_no_progress", "add_device", "positive_number", "add_res_scale", "guarded", "sr_errors_as_cli_errors", "check_max_pixels", "print_notes"]


@contextlib.contextmanager
def warnings_in_one_line(visible: bool = True) -> Any:
    """Show hpdl.sr's own warnings (a skipped image) as one ``hpdl: warning:`` line each, or
    none where not ``visible`` (the ranks of a training other than rank 0, which warns the same).

    Python's format adds the file and line of the code that warned, which tells a user nothing.
    Other packages' warnings keep Python's format.
    """
    import warnings

    package = os.path.dirname(os.path.abspath(__file__))
    previous = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if os.path.abspath(filename).startswith(package + os.sep):
            if visible:
                print(f"hpdl: warning: {message}", file=sys.stderr, flush=True)
        else:
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


# The packages of the sr extra (pyproject.toml) that a command cannot do without, by module.
SR_EXTRA = {"tqdm": "tqdm", "PIL": "pillow", "yaml": "pyyaml"}


def require_sr_extra(args: argparse.Namespace) -> None:
    """Refuse, before any work, a command whose modules of the sr extra (``args.sr_modules``)
    are not installed: one line, not a ModuleNotFoundError traceback minutes later. (The others
    are optional: TensorBoard and matplotlib, whose absence training notes; scikit-image, which
    only the embedded photos need and whose absence that dataset reports.)"""
    import importlib.util

    for module in args.sr_modules:
        if importlib.util.find_spec(module) is None:
            raise CliError(f"hpdl sr {args.sr_command} needs {SR_EXTRA[module]} (module {module}), which the "
                           "sr extra installs: pip install 'hpdl[sr]'")


def add_max_pixels(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, metavar="N",
                   help=f"{what} (default {DEFAULT_MAX_PIXELS:,})")


def add_no_progress(p: argparse.ArgumentParser, over: str) -> None:
    from hpdl.sr.progress import LOG_INTERVAL

    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help=f"no progress bar over the {over} (where stderr is not a terminal the bar appears only "
                   f"after {LOG_INTERVAL:.0f} s and redraws every {LOG_INTERVAL:.0f} s)")


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (default: cuda if available, else cpu), cpu, cuda or cuda:N")


def positive_number(text: str) -> float:
    """A finite number > 0, for argparse (its error is one line naming the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def add_res_scale(p: argparse.ArgumentParser) -> None:
    p.add_argument("--res-scale", type=positive_number, metavar="X",
                   help="EDSR's residual scaling of EDSR-PyTorch or BasicSR weights, which do not store it "
                   "(default: the published model's for its size, else 1.0); an hpdl checkpoint's must equal "
                   "its stored one")


def guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from hpdl.comm import discover_topology

        # These commands are one process's work: under a launcher of several ranks, rank 0 does it
        # (one table, one writer of each output) and the others end at once, successfully. An
        # upscale with --spatial is every rank's work, rank 0 reporting.
        if discover_topology().rank != 0:
            if not getattr(args, "spatial", False):
                return 0
            try:
                require_sr_extra(args)
            except CliError:  # every rank misses the same module: rank 0 says so
                raise SystemExit(2) from None
        else:
            require_sr_extra(args)
        with warnings_in_one_line(visible=discover_topology().rank == 0), sr_errors_as_cli_errors():
            return handler(args)

    return run


@contextlib.contextmanager
def sr_errors_as_cli_errors() -> Any:
    """Turn the sr errors (whose messages already name the file), the output rule's refusals and
    OSError (unwritable outputs) into the one line of a ``CliError`` (upscale --spatial's rank 0
    sends that line to the other ranks)."""
    from hpdl.output_files import OutputError
    from hpdl.sr.config import ConfigError
    from hpdl.sr.errors import CheckpointError, ModelMismatchError, SRDataError

    try:
        yield
    except (SRDataError, CheckpointError, ModelMismatchError, ConfigError, OutputError) as err:
        raise CliError(str(err)) from None
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        raise CliError(f"{where}{err.strerror or err}") from None


def check_max_pixels(args: argparse.Namespace) -> None:
    if args.max_pixels < 1:
        raise CliError(f"--max-pixels must be >= 1, got {args.max_pixels}")


def print_notes(checkpoint: dict) -> None:
    for note in checkpoint["meta"].get("notes", []):
        print(f"hpdl: note: {note}", file=sys.stderr, flush=True)
