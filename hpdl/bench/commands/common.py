"""What more than one of `hpdl bench`'s commands reads or writes the same way."""

from __future__ import annotations

import json
from typing import Any, Callable, Type


def size_option(flag: str, text: str) -> int:
    """``text`` as a byte count ("64MB", "10G"); a bad one is refused naming ``flag``."""
    from hpdl.formatting import parse_size
    from hpdl.cli_error import CliError

    try:
        return parse_size(text)
    except ValueError as err:
        raise CliError(f"{flag}: {err}") from None


def _keep_partial(args, record) -> str:
    """Write the record of a study that ended early to --json (its runs took minutes each);
    return what to add to the error line about it."""
    from hpdl.output_files import OutputError, OutputRule

    if record is None or not record["runs"]:
        return "; no job had ended, nothing written"
    if args.json is None:
        return f"; the {len(record['runs'])} run(s) done were not written (no --json)"
    try:
        OutputRule(overwrite=args.overwrite, make_directories=False).write(
            args.json, lambda f: json.dump(record, f, indent=1), option="--json")
    except OutputError as err:  # a file made there meanwhile: the study's error comes first
        return f"; the {len(record['runs'])} run(s) done were not written ({err})"
    return f"; wrote the {len(record['runs'])} run(s) done to {args.json} (no plot)"



def run_keeping_partial(args, run: Callable[[], Any], failed: Type[Exception], stopped: Type[BaseException]) -> Any:
    """``run()`` a study that starts jobs for minutes and return its record; its failure
    (``failed``) or a signal (``stopped``) ends the command in one line, the runs already done
    written to --json first. Both exceptions carry the partial ``record``, ``stopped`` its ``signum``."""
    from hpdl.cli_error import CliError

    try:
        return run()
    except failed as err:
        raise CliError(f"{err}{_keep_partial(args, err.record)}") from None
    except stopped as stop:
        raise CliError(f"{stop}{_keep_partial(args, stop.record)}", code=128 + stop.signum) from None
