"""A rank of an MPI job whose program ends on an uncaught exception ends the job.

Under MPICH, ``MPI_Finalize`` at a rank's exit waits for every other rank to finalize, so a rank
that raised (a bug on one rank, a file missing on one node) stayed alive in it while its peers
went on computing: they learnt of the loss only at their next collective (a peer evaluating
for 100 s without one kept the job alive 105 s), or never, where the failure came between
``import hpdl.torch`` (which starts MPI) and ``hvd.init()`` and a peer waited there. So at
exit, before mpi4py finalizes, such a rank enters a barrier of the world that only ranks
leaving on an error enter: where every rank gets there within ``GRACE_S`` (they all raised
alike) the job ends as it would have; else this rank aborts the job, which the launcher ends
on every rank.

A failure of hpdl's engine (a stall, a lost peer) is ended by :mod:`hpdl.engine.abort` before
this runs; a spatial group's refusal, decided alike on every rank, is printed in one line by
its own hook and does not count as an error here.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from typing import Any

from hpdl import rank_exit

GRACE_S = 3.0  # for every rank to leave alike, before this one ends the job
EXIT_CODE = 1

_uncaught = threading.Event()
_installed = False


def install(mpi: Any) -> None:
    """Watch this process's exit (once), ``mpi`` being mpi4py's MPI module, MPI started."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind, err, tb):
        previous(kind, err, tb)
        _uncaught.set()

    sys.excepthook = hook
    # Registered at import, so it runs after hpdl's own exit (hvd.shutdown()) and before
    # mpi4py's MPI_Finalize, which comes after every atexit handler.
    atexit.register(_end_the_job_if_leaving_on_an_error, mpi)


def _end_the_job_if_leaving_on_an_error(mpi: Any) -> None:
    if not _uncaught.is_set() or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    world = mpi.COMM_WORLD
    if world.Get_size() <= 1:
        return
    request = world.Ibarrier()
    deadline = time.monotonic() + GRACE_S
    while not request.Test():
        if time.monotonic() > deadline:
            _flush()
            sys.stderr.write(f"hpdl: rank {world.Get_rank()} ended on the error above while other ranks went on: "
                             "ending the job\n")
            _flush()
            rank_exit.note()  # its traceback said why: not named again by `hpdl run`
            world.Abort(EXIT_CODE)
        time.sleep(0.01)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep the job alive
            pass
