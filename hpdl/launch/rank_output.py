"""Where a rank's output goes: into its own files, or onto a shared stream with its rank in front.

``python -m hpdl.launch.rank_output DIR -- COMMAND ...``: `hpdl run --output-filename DIR`
starts every rank's command this way. Its stdout and stderr go to ``DIR/rank.<rank>/stdout``
and ``DIR/rank.<rank>/stderr``, the rank zero-padded to the width of the largest, as horovodrun
writes them; the rank comes from the launcher's variables. This process then becomes the
command (exec), so signals and the exit code are the command's own.

:func:`prefix_line`: the form of a rank's line where every rank's output shares one stream
(`hpdl.spark.run` forwards its ranks' output to the driver's), as Horovod writes it:
``[1]<stdout>:text``, with the local time in front when asked.
"""

from __future__ import annotations

import os
import sys
import time
from typing import List, Optional

from hpdl.atomic_file import make_directories
from hpdl.comm.topology import discover_topology


def rank_directory(directory: str, rank: int, size: int) -> str:
    """The directory of ``rank``'s output files: ``directory/rank.<rank>``, zero-padded."""
    return os.path.join(directory, f"rank.{rank:0{len(str(max(size - 1, 0)))}d}")


def prefix_line(rank: int, stream: str, line: str, timestamp: bool = False) -> str:
    """Return ``line`` as it appears among every rank's output: ``[rank]<stream>:line``.

    Args:
        stream: ``"stdout"`` or ``"stderr"``, the stream the rank wrote it to.
        timestamp: put the local time in front (``Mon Nov 27 12:00:00 2026[1]<stdout>:...``),
            as Horovod's ``prefix_output_with_timestamp``.
    """
    moment = time.asctime() if timestamp else ""
    return f"{moment}[{rank}]<{stream}>:{line}"


def main(argv: Optional[List[str]] = None) -> int:
    """Redirect this process's output into its rank's files, then exec the command."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        sys.stderr.write("usage: python -m hpdl.launch.rank_output DIR -- COMMAND ...\n")
        return 2
    directory, command = args[0], args[2:]
    try:
        topology = discover_topology()
        target = rank_directory(directory, topology.rank, topology.size)
        make_directories(target)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(os.path.join(target, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
    except (OSError, ValueError) as err:
        sys.stderr.write(f"hpdl: error: --output-filename {directory}: {getattr(err, 'strerror', None) or err}\n")
        return 2
    try:
        os.execvp(command[0], command)
    except OSError as err:
        sys.stderr.write(f"hpdl: error: cannot start {command[0]}: {err.strerror or err}\n")
        return 127
    return 1  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main())
