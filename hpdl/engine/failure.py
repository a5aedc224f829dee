"""How the engine fails: every request pending or still to come raises, and the whole job ends.

A failure is anything after which collectives can no longer complete on every rank: a backend
error (a peer's process or node lost), a stall timeout agreed in negotiation, an engine thread
that raised, or a round or collective stuck longer than the stall timeout, which the watch
thread notices since the engine thread, being the one stuck, cannot. The engine then enters
its failed state (every caller's handle raises the message, naming the ranks that no longer
answer where the backend can tell), arms the end of the job (abort.py) so that no rank is
left waiting on a lost peer, and, on a rank that stopped submitting and so has no handle to
raise through, raises in the main thread.

That work runs at the process's own priority: the engine thread's may be lowered
(HPDL_ENGINE_NICE), and, beside other busy processes, a thread at nice 19 waits seconds for
each moment of CPU, where the job must end within the abort's grace period. A failure found on
the engine thread is handed to the watch thread, which also starts the abort's watchdogs (a
thread inherits its creator's priority, and an unprivileged one cannot raise it back).

:class:`Failures` owns this on one engine: whether it has stopped or failed and why, the watch
thread and the end of the job. The engine (engine.py) holds one and tells it what it needs to
know (a round begins or ends, the ranks agreed to shut down, the engine thread has stopped);
it is handed what it asks of the engine: when the oldest collective in flight started,
whether any request waits, and how to fail them all.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Callable, Optional, Protocol

from hpdl.comm import CommError, Communicator
from hpdl.engine import abort
from hpdl.engine.clock import Clock
from hpdl.engine.errors import HorovodInternalError

log = logging.getLogger("hpdl.engine")

_LIVENESS_WAIT_S = 2.0  # after a backend failure, how long the survivors listen for each other
_WORLD_POLL_S = 0.2  # an elastic worker's watch: how often it asks whether its world has ended


class StallAbort(HorovodInternalError):
    """Raised asynchronously in the main thread of a rank that stopped submitting."""

    message = "collectives stalled"

    def __init__(self, *args):
        super().__init__(*(args or (self.message,)))


class _Handoff:
    """Work the engine thread hands the watch thread; run once, by whichever takes it first."""

    def __init__(self, work: Callable[[], None]):
        self.work = work
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self._taken = False
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken

    def run(self) -> None:
        try:
            self.work()
        except BaseException as err:  # noqa: BLE001 - raised again in the thread that handed it over
            self.error = err
        finally:
            self.done.set()


class WorldResets(Protocol):
    """An elastic job's worker (hpdl/torch/membership.py): a failure ends the world, not the
    job. Nothing is armed to end the process: the callers' next collective raises, and
    ``hvd.elastic.run`` forms the next world."""

    def lost_reason(self) -> Optional[str]:
        """Why this world ended elsewhere (a worker died, another rank failed), or None."""

    def lost(self, message: str) -> None:
        """This rank failed with ``message``: tell the others that the world has ended."""


class Failures:
    """Whether one engine has stopped or failed, and why; its watch thread; the end of the job.
    Any thread may ask; only its methods change it."""

    def __init__(self, comm: Communicator, stall_timeout_s: float, clock: Clock,
                 oldest_in_flight: Callable[[], Optional[float]], waiting: Callable[[], bool],
                 fail_requests: Callable[[str], None], resets: Optional[WorldResets] = None):
        """
        Args:
            comm: the world communicator (the end of the job aborts it; the ranks that no
                longer answer are asked through it).
            oldest_in_flight: when the oldest collective in flight started (clock time), if any.
            waiting: whether some request is pending or queued on this rank.
            fail_requests: fail every request pending, queued or in flight with a message.
            resets: an elastic job's worker: a failure ends the world (the others are told), and
                a world ended elsewhere fails this engine within a poll of the watch thread.
        """
        self._resets = resets
        self._comm = comm
        self._rank = comm.rank
        self._limit = stall_timeout_s
        self._clock = clock
        self._oldest_in_flight = oldest_in_flight
        self._waiting = waiting
        self._fail_requests = fail_requests
        self._failure: Optional[str] = None  # set once the end of the job is armed (see fail)
        self._failing = False  # fail() has begun (it sets _failure only after arming)
        self._failing_lock = threading.Lock()
        self._stopped = threading.Event()
        self._stop_message = "hpdl has been shut down (hvd.shutdown() was called on some rank)"
        self._end_requested: Optional[str] = None  # why the job is being ended (request_end)
        self._wake = threading.Event()  # the watch thread's pause ends early: stopped, or request_end
        self._main_thread_id = threading.main_thread().ident
        self._round_started: Optional[float] = None  # while a round runs: when it started (clock time)
        self._watcher = threading.Thread(target=self._watch, name="hpdl-engine-watch", daemon=True)
        self._lowered_thread: Optional[int] = None  # the thread whose priority was lowered
        self._handoffs: "list[_Handoff]" = []

    # -- what the engine tells it -----------------------------------------------------------

    def start_watch(self) -> None:
        """Start the watch thread (once the engine thread runs)."""
        self._watcher.start()

    def join_watch(self, timeout: float) -> None:
        """Wait for the watch thread, which ends once the engine thread has stopped."""
        self._watcher.join(timeout)

    def note_lowered_priority(self) -> None:
        """The calling thread (the engine's) runs at a lowered priority: the failures it finds
        are handled on the watch thread."""
        self._lowered_thread = threading.get_ident()

    def round_begins(self, now: float) -> None:
        """A round starts at ``now`` (clock time): the watch fails the engine if it lasts the
        stall timeout."""
        self._round_started = now

    def round_ends(self) -> None:
        self._round_started = None

    def shut_down(self, message: str) -> None:
        """The ranks agreed to stop: callers' errors say ``message`` from now on."""
        self._stop_message = message

    def mark_stopped(self) -> None:
        """The engine thread has stopped (from that thread); the watch ends."""
        self._stopped.set()
        self._wake.set()

    @property
    def failure(self) -> Optional[str]:
        """What every caller's error says once the engine has failed; None until then."""
        return self._failure

    @property
    def stopped(self) -> bool:
        """Whether the engine thread has stopped (or is about to): it runs nothing more."""
        return self._stopped.is_set()

    @property
    def stop_message(self) -> str:
        """What a caller's error says once the engine has stopped without failing."""
        return self._stop_message

    # -- the watch thread ----------------------------------------------------------------

    def _watch(self) -> None:
        """Fail the engine when one round, or one collective in flight, has run longer than
        the stall timeout.

        A round (negotiation and the collectives agreed in it) completes within moments while
        every rank's engine thread runs, even when some rank stops submitting; one that lasts
        the stall timeout is stuck in the backend on a peer that died or a node that can no
        longer be reached, where no error comes (MPI over TCP waits for ever). The engine
        thread cannot notice, being the one stuck, so this thread does.
        """
        limit = self._limit
        pause = min(1.0, limit / 4) if self._resets is None else min(_WORLD_POLL_S, limit / 4)
        while True:
            self._wake.wait(pause)
            self._wake.clear()
            while self._handoffs:
                handoff = self._handoffs.pop(0)
                if handoff.take():
                    handoff.run()
            if self._stopped.is_set():
                return
            lost = self._resets.lost_reason() if self._resets is not None else None
            if lost is not None and self._failure is None:
                # Another rank's failure or a dead worker ended this world: a rank computing meets
                # it at its next collective, without waiting for a peer that will not come.
                self.fail(f"hpdl engine failed on rank {self._rank}: the world ended: {lost}", ended=True)
                return
            if self._end_requested is not None and self._failure is None:
                self.fail(f"hpdl engine failed on rank {self._rank}: {self._end_requested}", ended=True)
                return
            started = self._round_started
            oldest = self._oldest_in_flight()
            now = self._clock.monotonic()
            if started is not None and now - started > limit and self._failure is None:
                err = CommError(f"a round of collectives has not completed in {limit:g} s (HPDL_STALL_TIMEOUT): "
                                "a rank has died or its node is unreachable")
            elif oldest is not None and now - oldest > limit and self._failure is None:
                err = CommError(f"a collective has not completed in {limit:g} s (HPDL_STALL_TIMEOUT): "
                                "a rank has died or its node is unreachable")
            else:
                err = None
            if err is not None:
                self.fail(f"hpdl engine failed on rank {self._rank}: {err}{self._lost(err)}", err)
                return

    # -- ending ----------------------------------------------------------------------------

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
        self._wake.set()
        return True

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the engine no longer runs collectives, in the words its callers' errors use (its
        failure, or a shutdown); None while it runs."""
        if self._failure is not None:
            return self._failure
        if self._stopped.is_set():
            return self._stop_message
        return None

    def end_job(self, reason: str) -> None:
        """End the whole job because a caller's own communication cannot complete, and return
        once its end is armed (Engine.end_job says when and why)."""
        message = f"hpdl engine failed on rank {self._rank}: {reason}"
        if self._failure is None and not self._stopped.is_set():
            self.fail(message, log_it=False, ended=True)
        if self._resets is not None:  # the world ends, not the job
            self._resets.lost(message)
            return
        # Armed here too when the engine had stopped, or another thread is failing it right now
        # (the first arming wins): the caller's exit must find the end armed.
        abort.arm(self._comm, self._rank, message, stalled=False)

    def fail_on(self, err: BaseException) -> None:
        """The engine thread raised ``err``: fail with it, naming the ranks that no longer answer
        after a backend failure."""
        # Asking the others takes up to _LIVENESS_WAIT_S: at normal priority too.
        self._at_normal_priority(lambda: self._fail(
            f"hpdl engine failed on rank {self._rank}: {type(err).__name__}: {err}{self._lost(err)}", err, True, False))

    def _lost(self, err: BaseException) -> str:
        """After a backend failure, the ranks that no longer answer, as words for the message."""
        comm = self._comm
        if self._resets is not None:
            return ""  # an elastic job's driver names the worker that died; no 2 s spent asking
        if comm.size == 1 or not isinstance(err, (CommError, RuntimeError)) or isinstance(err, HorovodInternalError):
            return ""
        try:
            lost = comm.unanswering(_LIVENESS_WAIT_S)
        except Exception:  # noqa: BLE001 - the failure is reported all the same
            return ""
        if not lost:
            return ""
        names = ", ".join(str(r) for r in lost)  # world ranks: the world communicator's own
        return f" (lost: rank {names} does not answer)" if len(lost) == 1 else f" (lost: ranks {names} do not answer)"

    def fail(self, message: str, cause: Optional[BaseException] = None, log_it: bool = True,
             ended: bool = False) -> None:
        """Enter the failed state: every pending and future request raises ``message``.

        ``ended``: the job is being ended from outside (:meth:`request_end`), not stalled here:
        a caller computing meets the error at its next collective (the job ends within the
        abort's grace period all the same); raised in the main thread meanwhile, it could land
        after that caller has met it, in its handler or in the end of the job itself.
        """
        self._at_normal_priority(lambda: self._fail(message, cause, log_it, ended))

    def _fail(self, message: str, cause: Optional[BaseException], log_it: bool, ended: bool) -> None:
        with self._failing_lock:  # the first failure wins (the watch thread, or the engine thread)
            if self._failing:
                return
            self._failing = True
        waiting = self._waiting()
        if log_it:
            log.error("%s", message)
        if self._resets is not None:
            # The others learn that this world has ended; this rank's callers raise, and
            # hvd.elastic.run forms the next world: nothing ends the process.
            self._failure = message
            self._resets.lost(message)
            self._fail_requests(message)
            return
        # Armed before any caller can see the failure: a caller that submits now raises at once
        # (engine.py reads ``failure``), and one that exits right after must find the job's end
        # armed, or its normal exit would end the process with status 0, or wait for a lost
        # peer in MPI_Finalize. This rank is the one that stopped submitting when it had
        # nothing pending.
        self.arm_end(message, stalled=not waiting and cause is None and not ended, publish=message)
        self._fail_requests(message)

    def arm_end(self, message: str, stalled: bool, publish: Optional[str] = None) -> None:
        """The job cannot go on: make sure it ends, even where no exception can reach
        (``stalled``: this rank stopped submitting, so no handle raises on it). ``publish``:
        the engine's failure, made visible to callers once the end is armed."""
        self._at_normal_priority(lambda: self._arm_end(message, stalled, publish))

    def _arm_end(self, message: str, stalled: bool, publish: Optional[str]) -> None:
        abort.arm(self._comm, self._rank, message, stalled)
        if publish is not None:
            self._failure = publish
        if stalled:
            # A stalled rank has no handle to raise through: raise in its main thread, as every
            # surviving rank does (it arrives if that thread is running Python).
            self._raise_in_main_thread(message)

    def _raise_in_main_thread(self, message: str) -> None:
        if self._main_thread_id is None:
            return
        StallAbort.message = message
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._main_thread_id), ctypes.py_object(StallAbort))

    def _at_normal_priority(self, work: Callable[[], None]) -> None:
        """Run ``work`` here, or, on the thread whose priority was lowered, on the watch thread
        (waiting for it); here all the same should the watch thread have ended."""
        if threading.get_ident() != self._lowered_thread or not self._watcher.is_alive():
            work()
            return
        handoff = _Handoff(work)
        self._handoffs.append(handoff)
        self._wake.set()
        while not handoff.done.wait(0.05):
            if not self._watcher.is_alive() and handoff.take():  # it ended without taking it
                handoff.run()
        if handoff.error is not None:
            raise handoff.error
