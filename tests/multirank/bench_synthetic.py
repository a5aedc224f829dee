"""Run `hpdl bench synthetic ARGS...` on every rank (the command line, as a user would)."""

import sys

from _common import run_main

from hpdl.cli import main


def _main() -> None:
    status = main(["bench", "synthetic", *sys.argv[1:]])
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    run_main(_main)
