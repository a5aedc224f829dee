"""How the engine fails: every request pending or still to come raises, and the whole job ends.

A failure is anything after which collectives can no longer complete on every rank: a backend
error (a peer's process or node lost), a stall timeout agreed in negotiation, an engine thread
that raised, or a round or collective stuck longer than the stall timeout, which the watch
thread notices since the engine thread, being the one stuck, cannot. The engine then enters
its failed state (every caller's handle raises the message, naming the ranks that no longer
answer where the backend can tell), arms the end of the job (abort.py) so that no rank is
left waiting on a lost peer, and, on a rank that stopped submitting and so has no handle to
raise through, raises in the main thread.

``EngineFailures`` is the Engine's half of this; it uses the engine's state (its queue,
process sets, executor and stop flags, engine.py).
"""

from __future__ import annotations

import collections
import ctypes
import logging
from typing import Optional

from hpdl.comm import CommError
from hpdl.engine import abort
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.process_set import ProcessSet

log = logging.getLogger("hpdl.engine")

_LIVENESS_WAIT_S = 2.0  # after a backend failure, how long the survivors listen for each other


class StallAbort(HorovodInternalError):
    """Raised asynchronously in the main thread of a rank that stopped submitting."""

    message = "collectives stalled"

    def __init__(self, *args):
        super().__init__(*(args or (self.message,)))


class EngineFailures:
    """The Engine's failure handling (mixed into :class:`hpdl.engine.engine.Engine`)."""

    def _watch(self) -> None:
        """Fail the engine when one round, or one collective in flight, has run longer than
        the stall timeout.

        A round (negotiation and the collectives agreed in it) completes within moments while
        every rank's engine thread runs, even when some rank stops submitting; one that lasts
        the stall timeout is stuck in the backend on a peer that died or a node that can no
        longer be reached, where no error comes (MPI over TCP waits for ever). The engine
        thread cannot notice, being the one stuck, so this thread does.
        """
        limit = self.settings.stall_timeout_s
        while True:
            self._watch_wake.wait(min(1.0, limit / 4))
            self._watch_wake.clear()
            if self._stopped.is_set():
                return
            if self._end_requested is not None and self._failure is None:
                self._fail(f"hpdl engine failed on rank {self.rank}: {self._end_requested}", ended=True)
                return
            started = self._round_started
            oldest = self.executor.oldest_in_flight()
            now = self.clock.monotonic()
            if started is not None and now - started > limit and self._failure is None:
                err = CommError(f"a round of collectives has not completed in {limit:g} s (HPDL_STALL_TIMEOUT): "
                                "a rank has died or its node is unreachable")
            elif oldest is not None and now - oldest > limit and self._failure is None:
                err = CommError(f"a collective has not completed in {limit:g} s (HPDL_STALL_TIMEOUT): "
                                "a rank has died or its node is unreachable")
            else:
                err = None
            if err is not None:
                self._fail(f"hpdl engine failed on rank {self.rank}: {err}{self._lost(err)}", err)
                return

    def request_end(self, reason: str) -> bool:
        """Fail the engine as a lost peer would, because the job is being ended (``reason``);
        return False when it has stopped already.

        Safe in a signal handler, whatever the interrupted code holds: it records the reason
        and wakes the watch thread (through an event no other code waits on or sets while
        holding its lock), which fails the engine: Open MPI sends SIGKILL 1 s after SIGTERM.
        """
        if self._stopped.is_set():
            return False
        self._end_requested = reason
        self._watch_wake.set()
        return True

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the engine no longer runs collectives, in the words its callers' errors use (its
        failure, or a shutdown: "hpdl has been shut down (rank 0 called hvd.shutdown(), or
        exited)"); None while it runs. For waits outside the engine that depend on every rank
        going on (a spatial group's halo exchanges)."""
        if self._failure is not None:
            return self._failure
        if self._stopped.is_set():
            return self._stop_message
        return None

    def end_job(self, reason: str) -> None:
        """End the whole job because a caller's own communication cannot complete (a spatial
        group's transfer that stalled, or whose peer's engine stopped), and return once its end
        is armed.

        The engine fails with ``reason`` as for a lost peer, unless it has stopped already; either
        way the job ends within the abort's grace period (abort.py), so that the caller's error,
        which it raises and reports itself (nothing is logged here), is followed by the end of
        the job and not by a normal exit, which would wait for the peers in ``MPI_Finalize``.
        Not for signal handlers (:meth:`request_end` is).
        """
        message = f"hpdl engine failed on rank {self.rank}: {reason}"
        if self._failure is None and not self._stopped.is_set():
            self._fail(message, log_it=False, ended=True)
        # Armed here too when the engine had stopped, or another thread is failing it right now
        # (the first arming wins): the caller's exit must find the end armed.
        abort.arm(self.comm, self.rank, message, stalled=False)

    def _lost(self, err: BaseException) -> str:
        """After a backend failure, the ranks that no longer answer, as words for the message."""
        if self.size == 1 or not isinstance(err, (CommError, RuntimeError)) or isinstance(err, HorovodInternalError):
            return ""
        try:
            lost = self.comm.unanswering(_LIVENESS_WAIT_S)
        except Exception:  # noqa: BLE001 - the failure is reported all the same
            return ""
        if not lost:
            return ""
        world = self._sets[0].ranks
        names = ", ".join(str(world[r]) for r in lost)
        return f" (lost: rank {names} does not answer)" if len(lost) == 1 else f" (lost: ranks {names} do not answer)"

    def _fail_set(self, ps: ProcessSet, message: str) -> None:
        pending, ps.pending = ps.pending, collections.OrderedDict()
        backlog, ps.backlog = ps.backlog, []
        queued, ps.queued = ps.queued, collections.deque()
        self._scheduler.dequeued(sum(nbytes for _, _, nbytes in queued))
        waiting = [request for _, request in backlog if request is not None]
        waiting += [request for _, requests, _ in queued for request in requests.values()]
        for request in list(pending.values()) + waiting:
            request.handle.set_error(HorovodInternalError(message))

    def _fail_queued(self) -> None:
        """Fail what is still in the queue of a stopped engine (from any thread)."""
        message = self._failure or self._stop_message
        while True:
            try:
                request = self._queue.popleft()
            except IndexError:
                return
            request.handle.set_error(HorovodInternalError(message))

    def _fail_pending(self, message: str) -> None:
        self.executor.fail_in_flight(HorovodInternalError(message))
        self._drain()
        for ps in self._sets.values():
            self._fail_set(ps, message)

    def _fail(self, message: str, cause: Optional[BaseException] = None, log_it: bool = True,
              ended: bool = False) -> None:
        """Enter the failed state: every pending and future request raises ``message``.

        ``ended``: the job is being ended from outside (:meth:`request_end`), not stalled here:
        a caller computing meets the error at its next collective (the job ends within the
        abort's grace period all the same); raised in the main thread meanwhile, it could land
        after that caller has met it, in its handler or in the end of the job itself.
        """
        if self._failure is not None:  # failed already (the watch thread was first)
            return
        self._failure = message
        waiting = any(ps.pending for ps in self._sets.values()) or bool(self._queue)
        if log_it:
            log.error("%s", message)
        # Armed before the waiting callers wake: one that raises and exits at once must find
        # the job's end armed, or its normal exit would wait for a lost peer. This rank is the
        # one that stopped submitting when it had nothing pending.
        self._end_job(message, stalled=not waiting and cause is None and not ended)
        self._fail_pending(message)

    def _end_job(self, message: str, stalled: bool) -> None:
        """The job cannot go on: make sure it ends, even where no exception can reach."""
        abort.arm(self.comm, self.rank, message, stalled)
        if stalled:
            # A stalled rank has no handle to raise through: raise in its main thread, as every
            # surviving rank does (it arrives if that thread is running Python).
            self._raise_in_main_thread(message)

    def _raise_in_main_thread(self, message: str) -> None:
        if self._main_thread_id is None:
            return
        StallAbort.message = message
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._main_thread_id), ctypes.py_object(StallAbort))
