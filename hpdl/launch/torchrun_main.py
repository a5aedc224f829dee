"""torchrun's own main, with a failed job reported in one line: ``python -m hpdl.launch.torchrun_main ARGS``.

`hpdl run` starts a job on this host through torchrun (``torchrun --standalone ...``, as
``--dry-run`` shows it). When a rank fails, torchrun ends the others and raises
``ChildFailedError`` out of its main: a Python traceback and a table of every rank's end, some
40 lines after the rank has said what went wrong. This module runs the same main (its own
argument parser and ``run``), and reports that failure as one line naming the first rank that
failed and how, then exits as that rank did (its exit code, or 128 + the signal), as `hpdl run`
does under mpiexec and srun. Anything else torchrun raises keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def command(torchrun_argv: Sequence[str]) -> list:
    """The command that runs ``torchrun_argv`` (``torchrun ARGS``) through this module."""
    return [sys.executable, "-m", __name__, *torchrun_argv[1:]]


def _status(exitcode: int) -> int:
    """The exit status of a job whose first failed rank ended with ``exitcode`` (negative: a signal)."""
    if exitcode < 0:
        return 128 - exitcode
    return exitcode or 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode < 0:
            how = f"was killed by signal {-failure.exitcode} ({failure.signal_name()})"
        else:
            how = f"exited with code {failure.exitcode}"
        sys.stdout.flush()
        sys.stderr.write(f"hpdl run: torchrun ended the job: rank {rank} {how}\n")
        return _status(failure.exitcode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
