"""The asynchronous collective engine: a request queue served by one background thread.

Every call of the API becomes a named :class:`Request` on the queue and returns a
:class:`Handle` at once. The engine thread runs cycles: it drains the queue, negotiates with
the other members of each process set which requests are ready everywhere (see
negotiation.py), runs them fused (execution.py) and completes the handles. A cycle starts every
``cycle_time_ms`` and at once when a request arrives at an idle engine.

When rounds run, when one is held back to gather more allreduces, and which prioritized
allreduces are queued and started is the scheduling policy's to decide (scheduling.py:
"Pacing", "Gathering", "Priorities"); this module acts on its decisions. Each part owns its
state and the engine asks it through its methods: the scheduler (scheduling.py), each process
set's state and backlog (process_set.py), the executor (execution.py) and the failure handling
(failure.py). The engine runs itself the requests that change it (join, process sets,
communicators: ``RequestKind.controls_engine``). Where the ranks' compute fills the CPU cores,
the engine thread also runs at the lowest priority (``HPDL_ENGINE_NICE``), so its polling and
copies use the gaps the compute leaves instead of preempting it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from hpdl.comm import Communicator
from hpdl.config import Settings
from hpdl.engine import autotune
from hpdl.engine import events as ev
from hpdl.engine.blocked import BLOCKED
from hpdl.engine.clock import SYSTEM_CLOCK, Clock
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.execution import Executor
from hpdl.engine.failure import Failures, WorldResets
from hpdl.engine.handle import Handle
from hpdl.engine.negotiation import FLAG_SHUTDOWN, TUNING_NONE, Controller, CycleResult, ranks_text
from hpdl.engine.process_set import ProcessSetState
from hpdl.engine.request import Request, RequestKind, Response
from hpdl.engine.scheduling import Scheduler

log = logging.getLogger("hpdl.engine")

def _lower_priority(increment: int) -> bool:
    """Raise the calling thread's nice value by ``increment`` (Linux: per-thread priorities);
    return whether it was raised."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        return True
    except (AttributeError, OSError) as err:  # not Linux, or not permitted: run at normal priority
        log.debug("could not lower the engine thread's priority: %s", err)
        return False


class Engine:
    """Owns the world communicator's collectives for one ``init()`` .. ``shutdown()`` span."""

    def __init__(self, settings: Settings, comm: Communicator, data_comm: Optional[Communicator] = None,
                 thread_nice: int = 0, autotuner: Optional[autotune.Autotuner] = None, clock: Clock = SYSTEM_CLOCK,
                 resets: Optional[WorldResets] = None):
        """Start the engine thread on ``comm`` (the world group).

        Args:
            data_comm: run the global set's collectives here instead of on ``comm`` (e.g. a
                HierarchicalCommunicator); negotiation always uses ``comm``.
            thread_nice: lower the engine thread's CPU priority by this nice increment.
            autotuner: on rank 0, the tuner whose parameters every rank applies (autotune.py).
            clock: what the engine's decisions read the time from and its thread waits on
                (a test's own clock; clock.py).
            resets: an elastic job's worker: a failure ends this world, not the job
                (failure.py's WorldResets).
        """
        self.thread_nice = thread_nice
        self.settings = settings
        self.autotuner = autotuner if comm.rank == 0 else None
        self._tuning = TUNING_NONE  # the tuning word last applied
        self.clock = clock
        self._scheduler = Scheduler(settings, clock)
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.bus = ev.EventBus()
        self.executor = Executor(self.bus, comm.rank, settings.fusion_threshold, settings.inplace_threshold,
                                 background=settings.background_collectives, on_done=self._collective_done,
                                 clock=clock)
        self._failures = Failures(comm, settings.stall_timeout_s, clock, self.executor.oldest_in_flight,
                                  waiting=self._waiting, fail_requests=self._fail_pending, resets=resets)
        self._sets: Dict[int, ProcessSetState] = {0: self._process_set(0, range(comm.size), comm, data_comm)}
        self._next_set_id = 1
        self._queue: "collections.deque[Request]" = collections.deque()
        self._in_flight: set = set()
        self._wake = threading.Event()
        # Why the engine was woken: a round is wanted (a submission, a waiter, shutdown), or
        # only a collective in flight is done (finished without a round).
        self._round_wanted = False
        self._collectives_done = False
        self._shutdown_requested = False
        self.cycles = 0
        self._timeline = None
        self._thread = threading.Thread(target=self._run, name="hpdl-engine", daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()  # the thread has set its priority
        self._failures.start_watch()

    def _process_set(self, set_id: int, ranks: Sequence[int], comm: Optional[Communicator],
                     data_comm: Optional[Communicator] = None) -> ProcessSetState:
        """The state of a process set of ``ranks``, negotiated on ``comm`` (None: this rank is
        not a member) and run on ``data_comm`` (default: ``comm``)."""
        controller = None
        if comm is not None:
            s = self.settings
            comm.control_wait_hook = self._service
            controller = Controller(comm, set_id, s.cache_capacity, s.stall_warning_s, s.stall_timeout_s,
                                    list(ranks), clock=self.clock, waits=self._blocked_waits if set_id == 0 else None)
        data = data_comm if data_comm is not None else comm
        paced, flight_window = self._scheduler.pacing(data, self.executor.background)
        return ProcessSetState(set_id, ranks, controller, data, paced=paced, flight_window=flight_window)

    # -- called from user threads ----------------------------------------------------------

    def submit(self, request: Request) -> Handle:
        """Queue a request; return its handle. Raises ValueError for a name already in flight."""
        key = (request.process_set_id, request.name)
        # No lock here: deque.append and set operations are atomic under the GIL, and a lock
        # shared with the engine thread would make every submission wait for a thread switch.
        failures = self._failures
        if failures.failure is not None:
            raise HorovodInternalError(failures.failure)
        if self._shutdown_requested:
            raise HorovodInternalError("hpdl has been shut down; call hvd.init() again first")
        if failures.stopped:  # by another rank: say which
            raise HorovodInternalError(failures.stop_message)
        ps = self._sets.get(request.process_set_id)
        if ps is None:
            raise ValueError(f"process set {request.process_set_id} does not exist (removed or never added)")
        if ps.controller is None:
            raise ValueError(f"rank {self.rank} is not a member of process set {request.process_set_id} "
                             f"(ranks {ps.ranks})")
        in_flight = self._in_flight
        if key in in_flight:
            raise ValueError(
                f"a collective named {request.name!r} is already in flight on this rank; "
                "wait for it (synchronize) before submitting another with the same name")
        in_flight.add(key)
        BLOCKED.submissions += 1  # this rank goes on: its blocked waits' ages restart (blocked.py)
        handle = request.handle = Handle(request.name, in_flight, key, self.expedite)
        self._queue.append(request)
        if failures.stopped:  # the engine stopped (a peer shut down, a failure) meanwhile
            self._fail_queued()
            return handle
        if self.bus.active:
            self.bus.emit(ev.Event(ev.QUEUED, request.kind.value, (request.name,), ev.now_us(),
                                   nbytes=request.nbytes, rank=self.rank, process_set_id=request.process_set_id))
        if self._scheduler.round_for_submission(request):
            self._round_wanted = True
            self._wake.set()
        return handle

    def expedite(self, handle: Optional[Handle] = None) -> None:
        """Someone waits for ``handle``: run the next cycle after at most the cycle time, and
        poll what is in flight often until it is done (the waiter's core is idle meanwhile)."""
        if self._scheduler.round_for_waiter(handle):
            self._round_wanted = True
            self._wake.set()

    def _collective_done(self) -> None:
        """From the backend's thread: a collective in flight is done; the engine finishes it."""
        self._collectives_done = True
        if any(ps.backlog.waiting for ps in list(self._sets.values())):  # room for the next prioritized ones: agree on them now
            self._round_wanted = True
        self._wake.set()

    @property
    def _backlogged(self) -> bool:
        return any(ps.backlog.waiting or ps.backlog.queued for ps in list(self._sets.values()))

    def _service(self) -> None:
        """Drive the backend's progress, finish the collectives in flight that are done and
        start the queued ones that now have room: in the engine's pauses, and between the polls
        of a round that waits."""
        executor = self.executor
        if executor.poll_interval_s():
            executor.poll()  # calls back (_collective_done) when one is done
        if self._collectives_done:
            self._collectives_done = False
            executor.complete()
        self._start_queued()

    def _start_queued(self) -> None:
        """Start the queued allreduces of every paced process set, in their agreed order, while
        they fit in the flight window (one at least when nothing is in flight)."""
        for ps in list(self._sets.values()):
            if ps.paced:
                self._start_queued_of(ps, everything=False)

    def _start_queued_of(self, ps: ProcessSetState, everything: bool) -> None:
        """Start ``ps``'s queued allreduces in their agreed order: all of them (before a round's
        own collectives), or while the scheduler lets them start between rounds."""
        executor = self.executor
        scheduler = self._scheduler
        backlog = ps.backlog
        while True:
            batch = backlog.head()
            if batch is None:
                return
            if not everything and not scheduler.may_start(executor.in_flight_bytes, batch.nbytes, ps.flight_window):
                return
            backlog.pop()
            executor.run(ps.data_comm, ps.id, batch.responses, batch.requests, self.cycles)

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine on every rank (the first rank to ask stops all); fail what is pending."""
        self._shutdown_requested = True
        self._round_wanted = True
        self._wake.set()
        if timeout is None:  # a failed engine's thread may be stuck in the backend for good
            timeout = 1.0 if self._failures.failure is not None else self.settings.stall_timeout_s + 60
        self._thread.join(timeout)
        # The watch thread ends with the engine thread. Joined here, not left to end during
        # interpreter exit: a thread that drops the engine's last reference then (its tensors)
        # is ended by the interpreter inside torch's C++ code, which aborts the process.
        self._failures.join_watch(2.0)
        self.stop_timeline()
        if self.autotuner is not None:
            self.autotuner.close()
        for ps in self._sets.values():
            if ps.controller is not None and ps.id != 0:
                ps.controller.comm.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def process_set_data_comm(self, set_id: int) -> Optional[Communicator]:
        ps = self._sets.get(set_id)
        return None if ps is None else ps.data_comm

    def stats(self) -> Dict[str, Any]:
        """Counters: cycles, negotiations (fast/full), cache hits/misses, fusion and bytes."""
        controllers = [ps.controller for ps in self._sets.values() if ps.controller is not None]
        out: Dict[str, Any] = {
            "cycles": self.cycles,
            "fast_negotiations": sum(c.fast_negotiations for c in controllers),
            "full_negotiations": sum(c.full_negotiations for c in controllers),
            "cache_hits": sum(c.cache.hits for c in controllers),
            "cache_misses": sum(c.cache.misses for c in controllers),
            "cache_entries": sum(len(c.cache) for c in controllers),
        }
        out.update(self.executor.stats())
        return out

    def start_timeline(self, path: str, mark_cycles: bool = False) -> None:
        """Write a Chrome-trace timeline of this rank's engine events to ``path`` (rank 0 only)."""
        from hpdl.engine.timeline import Timeline

        self.stop_timeline()
        if self.rank != 0:
            return
        self._timeline = Timeline(path, mark_cycles=mark_cycles)
        self.bus.add(self._timeline.observe)

    def stop_timeline(self) -> None:
        if self._timeline is not None:
            self.bus.remove(self._timeline.observe)
            self._timeline.close()
            self._timeline = None

    @property
    def timeline_path(self) -> Optional[str]:
        """The file this engine writes its timeline to (HPDL_TIMELINE, hvd.start_timeline()), or None."""
        return None if self._timeline is None else self._timeline.path

    # -- failure (failure.py) --------------------------------------------------------------

    def request_end(self, reason: str) -> bool:
        """Fail the engine as a lost peer would, because the job is being ended (``reason``);
        return False when it has stopped already.

        Safe in a signal handler, whatever the interrupted code holds: it records the reason
        and wakes the watch thread, which fails the engine: Open MPI sends SIGKILL 1 s after
        SIGTERM.
        """
        return self._failures.request_end(reason)

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the engine no longer runs collectives, in the words its callers' errors use (its
        failure, or a shutdown: "hpdl has been shut down (rank 0 called hvd.shutdown(), or
        exited)"); None while it runs. For waits outside the engine that depend on every rank
        going on (a spatial group's halo exchanges)."""
        return self._failures.stop_reason

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
        self._failures.end_job(reason)

    def _blocked_waits(self, min_age_s: float) -> Optional[Any]:
        """This rank's blocking waits, once one has lasted ``min_age_s`` (blocked.py), for the
        world's stall checks; a wait for a request needs the ranks that have not submitted it."""
        if not BLOCKED.waiting():
            return None

        def needs_of(set_id: int, name: str) -> Tuple[int, ...]:
            ps = self._sets.get(set_id)
            return tuple(ps.controller.missing.get(name, ())) if ps is not None and ps.controller is not None else ()

        return BLOCKED.report(min_age_s, needs_of)

    def _waiting(self) -> bool:
        """Whether some request is pending or queued on this rank, or a thread of it blocked in
        a wait that a failure ends (a spatial group's call, which watches the engine): then
        something raises on this rank (for failures.py)."""
        return any(ps.pending for ps in self._sets.values()) or bool(self._queue) or BLOCKED.waiting()

    def _fail_pending(self, message: str) -> None:
        """Fail every request in flight, queued or pending: their handles raise ``message``."""
        self.executor.fail_in_flight(HorovodInternalError(message))
        self._drain()
        for ps in self._sets.values():
            ps.fail(message)

    def _fail_queued(self) -> None:
        """Fail what is still in the queue of a stopped engine (from any thread)."""
        failures = self._failures
        message = failures.failure or failures.stop_message
        while True:
            try:
                request = self._queue.popleft()
            except IndexError:
                return
            request.handle.set_error(HorovodInternalError(message))

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        # The engine's copies (fusion buffer in and out) are never part of an autograd graph,
        # even when the caller's tensors require grad; grad mode is per thread.
        torch.set_grad_enabled(False)
        if self.thread_nice > 0 and _lower_priority(self.thread_nice):
            self._failures.note_lowered_priority()
        self._started.set()
        failures = self._failures
        try:
            scheduler = self._scheduler
            clock = self.clock
            while True:
                arrived = self._drain()
                gather_until = scheduler.gather_until(
                    self._sets.values(), backlogged=self._backlogged, shutting_down=self._shutdown_requested,
                    stall_check_s=self._sets[0].controller.stall_check_interval)
                if gather_until is not None:
                    if self._queue:  # submitted before the gathering began: count it first
                        self._round_wanted = True
                    self._pause(gather_until)
                    scheduler.end_gathering()
                    continue
                started = clock.monotonic()
                failures.round_begins(started)
                progressed = self._cycle()
                failures.round_ends()
                if progressed is None:
                    break
                self.cycles += 1
                self._pause(scheduler.next_round_at(started, progressed, arrived))
        except BaseException as err:  # noqa: BLE001 - surfaces in every caller's thread instead
            failures.fail_on(err)
        finally:
            failures.mark_stopped()
            self._fail_queued()  # submitted after the last drain: no engine will run them

    def _pause(self, until: float) -> None:
        """Sleep until ``until`` (clock time) or a reason for a round; finish the collectives
        in flight as the backend completes them, meanwhile and before the next round."""
        executor = self.executor
        scheduler = self._scheduler
        clock = self.clock
        while True:
            self._service()
            if self._round_wanted:
                break
            remaining = scheduler.wait_s(until, executor.poll_interval_s())
            if remaining <= 0:
                break
            clock.wait(self._wake, remaining)
            self._wake.clear()
        self._round_wanted = False
        self._wake.clear()
        if self._collectives_done:  # done while the flags were being cleared
            self._collectives_done = False
            executor.complete()

    def _drain(self) -> int:
        """Move submitted requests to their process set's pending table; return how many."""
        queue = self._queue
        now = self.clock.monotonic()
        count = len(queue)
        while queue:
            request = queue.popleft()
            request.arrival = now
            ps = self._sets.get(request.process_set_id)
            if ps is None:  # removed while the request waited in the queue
                request.handle.set_error(HorovodInternalError(
                    f"process set {request.process_set_id} was removed before {request.name!r} ran"))
                continue
            if request.kind is RequestKind.JOIN:
                self.executor.set_join_device(request.join_device)  # where this rank's zeros go on a GPU
            ps.admit(request)
        return count

    def _cycle(self) -> Optional[bool]:
        """Run one cycle over every process set.

        Returns None when the engine must stop, else whether anything ran or must run soon
        (a full negotiation, which joins also cause, or a process set with work).
        """
        self.executor.complete()  # what the backend finished since the last round
        world = self._sets[0]
        flags = FLAG_SHUTDOWN if self._shutdown_requested else 0
        sets_pending = 0
        for ps in self._sets.values():
            if ps.id and ps.pending and ps.id < 32:
                sets_pending |= 1 << ps.id
        room = self._scheduler.room(self.executor.in_flight_bytes,
                                    sum(ps.backlog.queued_bytes for ps in self._sets.values()))
        tuner = self.autotuner
        tuning = tuner.word() if tuner is not None else TUNING_NONE
        result = world.controller.cycle(world.pending, flags, sets_pending, room, tuning)
        if result.shutdown:
            for ps in list(self._sets.values()):  # agreed on every rank: they start everywhere
                self._start_queued_of(ps, everything=True)
            self.executor.complete(block=True)  # started on every rank: they finish everywhere
            who = ranks_text(result.shutdown_by)  # never empty: the ranks that asked say so
            message = f"hpdl has been shut down ({who} called hvd.shutdown(), or exited)"
            self._failures.shut_down(message)
            self._fail_pending(message)
            return None
        if result.abort is not None:
            self._failures.fail(result.abort, log_it=self.rank == 0)
            return None
        if result.tuning != self._tuning:
            self._retune(result.tuning)
        self._execute(world, result)
        if tuner is not None and tuner.active and result.responses:
            tuner.observe([r.name for r in result.responses if r.error is None],
                          sum(r.nbytes for r in result.responses if r.error is None))
        # Negotiations in flight (full exchanges, process sets with work) need every rank's
        # next round soon, even a rank with nothing of its own pending.
        hot = result.full or bool(result.sets_pending)
        ran = bool(result.responses)
        for set_id in sorted(self._sets):
            ps = self._sets.get(set_id)
            if set_id == 0 or ps is None or ps.controller is None:
                continue
            if set_id < 32 and not (result.sets_pending >> set_id) & 1 and not ps.backlog.waiting:
                continue
            sub = ps.controller.cycle(ps.pending, room=room)
            ran = ran or bool(sub.responses)
            hot = hot or sub.full
            if sub.abort is not None:  # a stall timeout within the set: the job is stuck as a whole
                self._failures.arm_end(sub.abort, stalled=not ps.pending)
                ps.fail(sub.abort)
                continue
            self._execute(ps, sub)
        backlogged = self._backlogged
        hot = hot or backlogged  # the backlog starts as room frees: rounds go on
        idle = not backlogged and not any(ps.pending for ps in self._sets.values())
        self._scheduler.after_round(hot, idle)
        if idle and self._queue:  # a submission raced the flag: do not sleep on it
            self._round_wanted = True
            self._wake.set()
        if self._timeline is not None and self._timeline.mark_cycles:
            self.bus.emit(ev.Event(ev.CYCLE, "cycle", (), ev.now_us(), rank=self.rank, cycle=self.cycles))
        return ran or hot

    def _retune(self, word: int) -> None:
        """Apply rank 0's autotuned parameters, agreed in this round on every rank. The fusion
        threshold decides how allreduces are fused into backend calls, so whatever was queued
        under the old one starts first, in the agreed order, as on every rank."""
        self._tuning = word
        parameters = autotune.decode(word)
        if parameters is None:
            return
        fusion_threshold, cycle_time_ms = parameters
        if fusion_threshold is not None and fusion_threshold != self.executor.fusion_threshold:
            for ps in list(self._sets.values()):
                self._start_queued_of(ps, everything=True)
            self.executor.retune(fusion_threshold)
        if cycle_time_ms is not None:
            self._scheduler.set_cycle_time(cycle_time_ms)

    def parameters(self) -> Dict[str, Any]:
        """The parameters the engine runs with now (autotuning changes them): the fusion
        threshold in bytes, the cycle time in ms, and whether rank 0 is still tuning (None on
        the other ranks)."""
        tuner = self.autotuner
        return {"fusion_threshold": self.executor.fusion_threshold, "cycle_time_ms": self._scheduler.cycle_time_ms,
                "autotuning": (tuner.active if tuner is not None else False) if self.rank == 0 else None}

    def _execute(self, ps: ProcessSetState, result: CycleResult) -> None:
        backlog = ps.backlog
        if not result.responses and not backlog.waiting and not backlog.queued:
            return
        popped = ps.take(result.responses)
        failed_groups = {request.group: response for response, request in zip(result.responses, popped)
                         if response.error is not None and request is not None and request.group is not None}
        if failed_groups:
            ps.fail_groups(failed_groups, popped)
        requests: Dict[str, Request] = {}
        ready: List[Response] = []
        controls: List[Tuple[Response, Optional[Request]]] = []  # the requests that change the engine
        allreduce = RequestKind.ALLREDUCE
        for response, request in zip(result.responses, popped):
            kind = response.kind
            if kind is allreduce:
                if response.priority is not None and response.error is None and response.group is None:
                    backlog.add(response, request)
                    continue
            elif response.error is None and kind.controls_engine:
                controls.append((response, request))
                continue
            ready.append(response)
            if request is not None:
                requests[response.name] = request
        if ready or controls:
            # What the round agreed runs after what earlier rounds queued, as on every rank
            # (only a paced set keeps a queue from one round to the next).
            self._start_queued_of(ps, everything=True)
            t = ev.now_us()
            now = self.clock.monotonic()
            for response, request in zip(result.responses, popped):
                # When the engine thread took the request from its queue, on the wall clock.
                drained = t - (now - request.arrival) * 1e6 if request is not None else t
                self.bus.emit(ev.Event(ev.NEGOTIATED, response.kind.value, (response.name,), t, rank=self.rank,
                                       process_set_id=ps.id, cycle=self.cycles, drained_us=drained))
            # The executor emits DONE as each collective completes (allreduces may finish rounds
            # later); the requests that change the engine run after the round's collectives, in
            # the same order on every rank.
            if ready:
                self.executor.run(ps.data_comm, ps.id, ready, requests, self.cycles)
            for response, request in controls:
                self._control(ps, response, request)
        if backlog.waiting:
            backlog.queue(result.room, self._scheduler.batches_to_queue)
        self._start_queued_of(ps, everything=not ps.paced)

    def _control(self, ps: ProcessSetState, response: Response, request: Optional[Request]) -> None:
        """Run a request that changes the engine itself (``RequestKind.controls_engine``): join,
        process-set changes, a communicator split off; a failure fails the request alone."""
        handle = request.handle if request is not None else None
        try:
            result = self._change(response)
        except Exception as err:  # noqa: BLE001 - as a failed collective's
            if handle is not None:
                handle.set_error(HorovodInternalError(
                    f"{response.kind.value} of tensor {response.name!r} failed: {err}"))
        else:
            if handle is not None:
                handle.set_result(result)
            elif isinstance(result, Communicator):  # a communicator split off for the caller that joined
                result.close()
        if self.bus.active:
            self.bus.emit(ev.Event(ev.DONE, response.kind.value, (response.name,), ev.now_us(), rank=self.rank,
                                   process_set_id=ps.id, cycle=self.cycles))

    def _change(self, response: Response) -> Any:
        """Carry out ``response``, a request that changes the engine; return the caller's result."""
        kind = response.kind
        if kind is RequestKind.JOIN:
            return response.last_joined
        if kind is RequestKind.ADD_PROCESS_SET:
            ranks = list(response.signature.ranks)
            sub = self.comm.split(ranks)  # collective over every rank, in the agreed order
            set_id = self._next_set_id
            self._next_set_id += 1
            self._sets[set_id] = self._process_set(set_id, ranks, sub)
            return set_id
        if kind is RequestKind.SPLIT_COMMUNICATOR:
            return self.comm.split(list(response.signature.ranks))  # collective, in the agreed order
        if kind is RequestKind.REMOVE_PROCESS_SET:
            set_id = response.signature.removed_set
            ps = self._sets.pop(set_id, None)
            if ps is not None:
                ps.fail(f"process set {set_id} was removed")
                if ps.controller is not None:
                    ps.controller.comm.close()
            return set_id
        raise HorovodInternalError(f"{kind.value} does not change the engine")  # pragma: no cover
