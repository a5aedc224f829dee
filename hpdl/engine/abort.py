"""Aborting the whole job once the engine has failed for good on this rank.

A stall timeout, a lost peer or an engine error leaves the job unable to go on, and ending it
takes more than raising an exception: the rank that stopped submitting may sit in C code (a
data loader, a stuck file system) or in ``time.sleep``, where the exception raised for it in
its main thread does not arrive, and the survivors, once they have reported the error, would
wait for it forever in ``MPI_Finalize``. So a failure arms the end of the job:

1. at once, a rank that had stopped submitting prints where its threads are (faulthandler),
   since it may never get to report anything else;
2. at interpreter exit (the survivors have printed their error by then), the job is aborted
   instead of finalized: after a short pause that lets the other survivors print theirs;
3. ``ABORT_GRACE_S`` after the failure, whatever this process is doing, a watchdog thread
   aborts the job; a C-level watchdog (faulthandler, which needs no GIL) follows
   ``_C_WATCHDOG_AFTER_S`` later, for a main thread that holds the GIL inside C code.

Aborting is the communicator's: ``MPI_Abort`` on the world communicator under MPI (the
launcher then ends every rank, as mpi4py's ``-m mpi4py`` runner does for an uncaught
exception); on torch.distributed, the process group is aborted and the process exits, and the
peers' connections close under them.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
import traceback
from typing import Callable, List, Optional

from hpdl import rank_exit
from hpdl.comm import Communicator

ABORT_GRACE_S = 3.0  # from the failure to the end of the job, at most (documented in README)
EXIT_CODE = 1
_SURVIVOR_PAUSE_S = 1.0  # at exit, before aborting: time for the other ranks to print their error
_C_WATCHDOG_AFTER_S = 2.0  # after the grace period, should the watchdog thread never get the GIL
_HOOKS_MAX_S = 5.0  # failure hooks (the profiler's last write) that run longer are not waited for


class _Armed:
    def __init__(self, comm: Communicator, message: str):
        self.comm = comm
        self.message = message
        self.deadline = time.monotonic() + ABORT_GRACE_S + _HOOKS_MAX_S
        self.hooks_done = threading.Event()  # the grace period runs from here


_lock = threading.Lock()
_armed: Optional[_Armed] = None
# Run once at the failure, in the thread that detected it: last words that must not wait for an
# exit this rank may never reach (the profiler writes this rank's part of its recording).
_failure_hooks: List[Callable[[], None]] = []


def add_failure_hook(hook: Callable[[], None]) -> None:
    """Call ``hook()`` when a failure arms the end of the job (before the grace period runs out)."""
    if hook not in _failure_hooks:
        _failure_hooks.append(hook)


def remove_failure_hook(hook: Callable[[], None]) -> None:
    if hook in _failure_hooks:
        _failure_hooks.remove(hook)


def remaining() -> float:
    """Seconds until the watchdog aborts the job (infinite while nothing has failed)."""
    armed = _armed
    return float("inf") if armed is None else max(0.0, armed.deadline - time.monotonic())


def arm(comm: Communicator, rank: int, message: str, stalled: bool) -> None:
    """Arm the end of the job after ``message`` failed the engine (the first failure wins).

    Args:
        comm: the world communicator, whose ``abort`` ends the job.
        stalled: this rank had submitted nothing the others waited for: print its stacks now.
    """
    global _armed
    with _lock:
        if _armed is not None:
            return
        armed = _armed = _Armed(comm, message)
    if stalled:
        _print_stacks(rank, message)
    # The watchdogs start first: a hook that hangs must not keep the job alive.
    threading.Thread(target=_watchdog, args=(armed, rank), name="hpdl-abort", daemon=True).start()
    faulthandler.dump_traceback_later(ABORT_GRACE_S + _HOOKS_MAX_S + _C_WATCHDOG_AFTER_S, exit=True)
    for hook in list(_failure_hooks):
        try:
            hook()
        except Exception as err:  # noqa: BLE001 - the job must still end
            sys.stderr.write(f"hpdl: rank {rank}: {getattr(hook, '__qualname__', hook)} at the failure failed: "
                             f"{type(err).__name__}: {err}\n")
    armed.deadline = min(armed.deadline, time.monotonic() + ABORT_GRACE_S)
    armed.hooks_done.set()


def failed() -> bool:
    """Return whether a failure has armed the end of the job in this process."""
    return _armed is not None


def abort_if_failed() -> None:
    """At interpreter exit: abort the job if the engine failed (a normal exit would hang)."""
    armed = _armed
    if armed is None:
        return
    armed.hooks_done.wait(max(0.0, armed.deadline - time.monotonic()))
    time.sleep(max(0.0, min(_SURVIVOR_PAUSE_S, armed.deadline - time.monotonic())))
    _abort(armed)


def _print_stacks(rank: int, message: str) -> None:
    """Print where this rank's other threads are: what kept it from submitting."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [f"hpdl: rank {rank} stopped submitting collectives: {' '.join(message.split())}\n",
             f"hpdl: where rank {rank}'s threads are (the job ends within {ABORT_GRACE_S:g} s):\n"]
    for ident, frame in sys._current_frames().items():
        if ident != me:
            lines.append(f"  thread {names.get(ident, ident)!r}, most recent call last:\n")
            lines += ["  " + line for entry in traceback.format_stack(frame) for line in entry.splitlines(True)]
    _flush()
    sys.stderr.write("".join(lines))
    _flush()


def _watchdog(armed: _Armed, rank: int) -> None:
    armed.hooks_done.wait(max(0.0, armed.deadline - time.monotonic()))
    time.sleep(max(0.0, armed.deadline - time.monotonic()))
    _flush()
    sys.stderr.write(f"hpdl: rank {rank}: the job had not ended {ABORT_GRACE_S:g} s after the collectives "
                     "failed; aborting it\n")
    _abort(armed)


def _abort(armed: _Armed) -> None:
    _flush()
    rank_exit.note()  # the error is printed: this end is no loss for `hpdl run` to report
    armed.comm.abort(EXIT_CODE)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not stop the abort
            pass
