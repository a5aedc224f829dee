"""The asynchronous collective engine: a request queue served by one background thread.

Every call of the API becomes a named :class:`Request` on the queue and returns a
:class:`Handle` at once. The engine thread runs cycles: it drains the queue, negotiates with
the other members of each process set which requests are ready everywhere (see
negotiation.py), runs them fused (execution.py) and completes the handles. A cycle starts every
``cycle_time_ms`` and at once when a request arrives at an idle engine.

Pacing. A cycle is a collective round: every member's engine thread must take part, and on a
machine whose cores are all busy computing (data-parallel training), each round costs CPU
time taken from the compute, more so when a peer's thread is descheduled and the others poll
for it. So rounds happen when they can achieve something:
- a rank with nothing pending sleeps until its next submission wakes it, or for at most
  ``_IDLE_PAUSE_MIN_S``, doubled after each idle round that agreed nothing, up to
  ``_IDLE_PAUSE_MAX_S``: in data-parallel training every rank submits the same tensors, so
  the round a peer started is joined when this rank's own gradient arrives, not by a timer;
- a rank whose pending requests a round could not run (a peer has not submitted them yet)
  doubles its pause after each such fruitless round, up to ``_BUSY_PAUSE_CAP_S``;
- a full negotiation or a process set with work keeps every rank at the cycle time, and a
  caller starting to wait on a handle cuts a doubled pause short.
A request submitted to an idle engine thus still starts a cycle at once (unless it is
gathered, below), and the cycle time bounds the latency of a collective whose ranks are all
ready; one that a peer idle for long has not submitted waits for that peer's timer (at most
``_IDLE_PAUSE_MAX_S``) to learn that it cannot run yet. Where the ranks' compute fills the CPU
cores, the engine thread also runs at the lowest priority (``HPDL_ENGINE_NICE``), so
its polling and copies use the gaps the compute leaves instead of preempting it.

Gathering. Each round costs every rank CPU time (the negotiation, then starting the agreed
collectives), whatever it agrees. Backward makes gradients one layer at a time, milliseconds
apart; a round per gradient is a round and a backend call per tensor, which on CPU-bound nodes
comes out of the compute (EDSR-baseline across two nodes: 76 rounds per step, 40 ms of the
engine's CPU per 460 ms step; docs/perf.md). So while every request pending is an allreduce
that no caller waits for yet, the engine gathers instead of running a round: until
``HPDL_GATHER_BYTES`` of them are pending (a fused message worth a round), the oldest has
waited ``HPDL_GATHER_TIME``, a caller starts waiting for one (the optimizer's step, a
synchronous call), or as many bytes are pending as the latest submission says are still to
come (``Request.bytes_to_come``), whichever comes first. The last rule is for the end of a
step: whatever is held when backward ends is transferred while the optimizer waits, so the
held bytes halve as the step's last gradients arrive (the optimizer knows how many bytes are
left) and the last round carries about one gradient, as without gathering. Every rank
gathers by the same rule over the same tensors, so the ranks reach their rounds together.

Priorities. An allreduce submitted with a priority (DistributedOptimizer does so when the next
forward overlaps the gradients' exchange: the first layers' gradients are needed first, but
backward makes them last) is not started as soon as it is agreed: it waits in its process
set's backlog, and each round queues the backlog's most urgent allreduces that fit in the
room every member has left in its window of ``HPDL_PRIORITY_WINDOW`` bytes in flight or
queued (the room travels in the negotiation, so every rank queues the same ones in the same
order). Each rank starts its queue in that order as its window frees (half of it in flight
where collectives progress side by side, as MPI's do; see ``_pace``), without waiting
for a round: between rounds, and while a round waits (the backend calls back,
``Communicator.control_wait_hook``), since over TCP a round's control message can queue
behind megabytes of data and a late peer can hold a round for milliseconds, during which the
link would otherwise run dry. A round's own collectives start after everything queued
before them, so every rank starts the same collectives in the same order. What is still in
the backlog can be overtaken; what is queued or started, cannot, so the window is kept
small, just enough to keep the network busy.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from hpdl.comm import Communicator
from hpdl.config import Settings
from hpdl.engine import autotune
from hpdl.engine import events as ev
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.execution import Executor
from hpdl.engine.failure import EngineFailures
from hpdl.engine.handle import Handle
from hpdl.engine.negotiation import FLAG_SHUTDOWN, ROOM_UNITS, TUNING_NONE, Controller, CycleResult, ranks_text
from hpdl.engine.process_set import ProcessSet
from hpdl.engine.request import SIG_ROOT, SIG_SPLITS, Request, RequestKind, Response

log = logging.getLogger("hpdl.engine")

_BUSY_PAUSE_CAP_S = 0.005  # longest pause between fruitless rounds while this rank has requests pending
# Pauses of a rank with nothing pending (its own submissions wake it at once): the first, and
# the longest they double to while its rounds agree nothing (each costs the compute CPU time).
_IDLE_PAUSE_MIN_S = 0.02
_IDLE_PAUSE_MAX_S = 0.1
# How often collectives that move only when polled (MPI over TCP) are polled while a caller
# waits for a result: its core is idle then, and every protocol step the backend takes only
# when called (a rendezvous, a reduction) would otherwise wait for the next poll. Otherwise
# they are polled as often as the backend asks (InFlight.poll_interval_s).
_AWAITED_POLL_INTERVAL_S = 5e-5


def _lower_priority(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux: per-thread priorities)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except (AttributeError, OSError) as err:  # not Linux, or not permitted: run at normal priority
        log.debug("could not lower the engine thread's priority: %s", err)


class Engine(EngineFailures):
    """Owns the world communicator's collectives for one ``init()`` .. ``shutdown()`` span."""

    def __init__(self, settings: Settings, comm: Communicator, data_comm: Optional[Communicator] = None,
                 thread_nice: int = 0, autotuner: Optional[autotune.Autotuner] = None):
        """Start the engine thread on ``comm`` (the world group).

        Args:
            data_comm: run the global set's collectives here instead of on ``comm`` (e.g. a
                HierarchicalCommunicator); negotiation always uses ``comm``.
            thread_nice: lower the engine thread's CPU priority by this nice increment.
            autotuner: on rank 0, the tuner whose parameters every rank applies (autotune.py).
        """
        self.thread_nice = thread_nice
        self.settings = settings
        self.autotuner = autotuner if comm.rank == 0 else None
        self._tuning = TUNING_NONE  # the tuning word last applied
        self._cycle_time_ms = settings.cycle_time_ms
        self._cycle_s = settings.cycle_time_ms / 1000.0
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.bus = ev.EventBus()
        self._window = settings.priority_window
        self._queued_bytes = 0
        self.executor = Executor(self.bus, comm.rank, settings.fusion_threshold, settings.inplace_threshold,
                                 background=settings.background_collectives, on_done=self._collective_done)
        world = ProcessSet(0, range(comm.size), self._controller(comm, 0, range(comm.size)), data_comm)
        self._pace(world)
        self._sets: Dict[int, ProcessSet] = {0: world}
        self._next_set_id = 1
        self._queue: "collections.deque[Request]" = collections.deque()
        self._in_flight: set = set()
        self._wake = threading.Event()
        # Why the engine was woken: a round is wanted (a submission, a waiter, shutdown), or
        # only a collective in flight is done (finished without a round).
        self._round_wanted = False
        self._collectives_done = False
        self._shutdown_requested = False
        self._stopped = threading.Event()
        self._failure: Optional[str] = None
        self._end_requested: Optional[str] = None  # why the job is being ended (request_end)
        self._watch_wake = threading.Event()  # the watch thread's pause ends early: stopped, or request_end
        self._stop_message = "hpdl has been shut down (hvd.shutdown() was called on some rank)"
        self._main_thread_id = threading.main_thread().ident
        self.cycles = 0
        self._fruitless = 0  # consecutive rounds that agreed nothing with no new local request
        self._idle = True  # nothing pending on this rank: a submission wakes the engine at once
        self._idle_pause = _IDLE_PAUSE_MIN_S  # the next pause of an idle rank
        self._gathering = False  # holding the next round back (see Gathering): a waiter wakes the engine
        self._gathered = 0  # while gathering: the bytes pending
        self._hot = False  # the last round started a negotiation that needs quick rounds
        self._timeline = None
        self._round_started: Optional[float] = None  # while a round runs: when it started
        self._awaited: Optional[Handle] = None  # the handle a caller last started waiting for
        self._thread = threading.Thread(target=self._run, name="hpdl-engine", daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()  # the thread has set its priority
        self._watcher = threading.Thread(target=self._watch, name="hpdl-engine-watch", daemon=True)
        self._watcher.start()

    def _controller(self, comm: Communicator, set_id: int, ranks: Sequence[int]) -> Controller:
        s = self.settings
        comm.control_wait_hook = self._service
        return Controller(comm, set_id, s.cache_capacity, s.stall_warning_s, s.stall_timeout_s, list(ranks))

    def _pace(self, ps: ProcessSet) -> None:
        """Set how ``ps``'s queued allreduces start. Between rounds, as room frees, only where
        they run in the background: a blocking call started outside the agreed order of rounds
        could wait for a peer blocked in another process set's collective. Where they progress
        side by side (MPI), half the window is in flight and half queued, so that the urgent
        ones are not slowed by many others sharing the network; where they run in order
        (gloo, nccl) the backend's own queue does that, and the whole window is in flight."""
        comm = ps.data_comm
        ps.paced = self.executor.background and bool(getattr(comm, "background_collectives", False))
        in_order = getattr(comm, "runs_in_order", True)
        ps.flight_window = self._window if in_order else max(1, self._window // 2)

    # -- called from user threads ----------------------------------------------------------

    def submit(self, request: Request) -> Handle:
        """Queue a request; return its handle. Raises ValueError for a name already in flight."""
        key = (request.process_set_id, request.name)
        # No lock here: deque.append and set operations are atomic under the GIL, and a lock
        # shared with the engine thread would make every submission wait for a thread switch.
        if self._failure is not None:
            raise HorovodInternalError(self._failure)
        if self._shutdown_requested:
            raise HorovodInternalError("hpdl has been shut down; call hvd.init() again first")
        if self._stopped.is_set():  # by another rank: say which
            raise HorovodInternalError(self._stop_message)
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
        handle = request.handle = Handle(request.name, in_flight, key, self.expedite)
        self._queue.append(request)
        if self._stopped.is_set():  # the engine stopped (a peer shut down, a failure) meanwhile
            self._fail_queued()
            return handle
        if self.bus.active:
            self.bus.emit(ev.Event(ev.QUEUED, request.kind.value, (request.name,), ev.now_us(),
                                   nbytes=request.nbytes, rank=self.rank, process_set_id=request.process_set_id))
        if self._idle:
            self._idle = False
            self._round_wanted = True
            self._wake.set()
        elif self._gathering:
            # Counted here, so that the engine sleeps through the submissions of a gathering
            # (a wake-up per gradient would cost the compute a thread switch each).
            gathered = self._gathered = self._gathered + request.nbytes
            if (request.kind is not RequestKind.ALLREDUCE
                    or not self._worth_holding(gathered, request.bytes_to_come)):
                self._round_wanted = True
                self._wake.set()
        return handle

    def expedite(self, handle: Optional[Handle] = None) -> None:
        """Someone waits for ``handle``: run the next cycle after at most the cycle time, and
        poll what is in flight often until it is done (the waiter's core is idle meanwhile)."""
        self._awaited = handle
        if self._fruitless or self._gathering:
            self._fruitless = 0
            self._round_wanted = True
            self._wake.set()

    def _collective_done(self) -> None:
        """From the backend's thread: a collective in flight is done; the engine finishes it."""
        self._collectives_done = True
        if any(ps.backlog for ps in list(self._sets.values())):  # room for the next prioritized ones: agree on them now
            self._round_wanted = True
        self._wake.set()

    @property
    def _backlogged(self) -> bool:
        return any(ps.backlog or ps.queued for ps in list(self._sets.values()))

    def _room(self) -> int:
        """This rank's room for prioritized allreduces, in units of the window: what is in
        flight and what is queued to start counts against it."""
        in_flight = self.executor.in_flight_bytes + self._queued_bytes
        if in_flight <= 0:
            return ROOM_UNITS
        return max(0, self._window - in_flight) * ROOM_UNITS // self._window

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

    def _start_queued_of(self, ps: ProcessSet, everything: bool) -> None:
        executor = self.executor
        queued = ps.queued
        while queued:
            responses, requests, nbytes = queued[0]
            in_flight = executor.in_flight_bytes
            if not everything and in_flight > 0 and in_flight + nbytes > ps.flight_window:
                return
            queued.popleft()
            self._queued_bytes -= nbytes
            executor.run(ps.data_comm, ps.id, responses, requests, self.cycles, self._special)

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine on every rank (the first rank to ask stops all); fail what is pending."""
        self._shutdown_requested = True
        self._round_wanted = True
        self._wake.set()
        if timeout is None:  # a failed engine's thread may be stuck in the backend for good
            timeout = 1.0 if self._failure is not None else self.settings.stall_timeout_s + 60
        self._thread.join(timeout)
        # The watch thread ends with the engine thread. Joined here, not left to end during
        # interpreter exit: a thread that drops the engine's last reference then (its tensors)
        # is ended by the interpreter inside torch's C++ code, which aborts the process.
        self._watcher.join(2.0)
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

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        # The engine's copies (fusion buffer in and out) are never part of an autograd graph,
        # even when the caller's tensors require grad; grad mode is per thread.
        torch.set_grad_enabled(False)
        if self.thread_nice > 0:
            _lower_priority(self.thread_nice)
        self._started.set()
        try:
            while True:
                arrived = self._drain()
                gather_until = self._gather_until()
                if gather_until is not None:
                    self._pause(gather_until)
                    self._gathering = False
                    continue
                started = self._round_started = time.monotonic()
                progressed = self._cycle()
                self._round_started = None
                if progressed is None:
                    break
                self.cycles += 1
                cycle_s = self._cycle_s
                if self._idle:
                    # Nothing pending here: the next local submission wakes the engine. Peers
                    # with work wait for this rank's next round, which they get at once if they
                    # submit the same tensors (the data-parallel case) and within the idle
                    # pause otherwise; it grows while the rounds find nothing to do (in
                    # training: the forward), as each costs the compute CPU time.
                    self._fruitless = 0
                    if progressed:
                        self._idle_pause = _IDLE_PAUSE_MIN_S
                    pause = cycle_s if self._hot else max(self._idle_pause, cycle_s)
                    if not progressed:
                        self._idle_pause = min(2 * self._idle_pause, _IDLE_PAUSE_MAX_S)
                elif progressed or arrived:
                    self._fruitless = 0
                    pause = cycle_s
                else:
                    self._fruitless = fruitless = min(self._fruitless + 1, 30)
                    pause = min(cycle_s * (1 << fruitless), max(_BUSY_PAUSE_CAP_S, cycle_s))
                self._pause(started + pause)
        except BaseException as err:  # noqa: BLE001 - surfaces in every caller's thread instead
            self._fail(f"hpdl engine failed on rank {self.rank}: {type(err).__name__}: {err}{self._lost(err)}", err)
        finally:
            self._stopped.set()
            self._watch_wake.set()
            self._fail_queued()  # submitted after the last drain: no engine will run them

    def _gather_until(self) -> Optional[float]:
        """Until when to hold the next round back to gather more allreduces (see Gathering),
        or None to run it now. Sets the engine gathering when it returns a time."""
        settings = self.settings
        if not settings.gather_bytes or self._shutdown_requested or self._hot or self._backlogged:
            return None
        awaited = self._awaited
        if awaited is not None and not awaited.poll():
            return None
        pending_bytes = 0
        oldest = newest = None
        allreduce = RequestKind.ALLREDUCE
        for ps in self._sets.values():
            for request in ps.pending.values():
                if request.kind is not allreduce:
                    return None
                pending_bytes += request.nbytes
                if oldest is None or request.arrival < oldest:
                    oldest = request.arrival
                if newest is None or request.arrival >= newest.arrival:
                    newest = request
        if oldest is None or not self._worth_holding(pending_bytes, newest.bytes_to_come):
            return None
        # Never past the point where a round must check for stalled requests (negotiation.py).
        hold = min(settings.gather_time_ms / 1000.0, self._sets[0].controller.stall_check_interval)
        until = oldest + hold
        if until <= time.monotonic():
            return None
        self._gathered = pending_bytes
        self._gathering = True
        self._idle = False  # submissions are counted (submit) rather than each waking the engine
        if self._queue:  # submitted before the flag was up: count it first
            self._round_wanted = True
        return until

    def _worth_holding(self, gathered: int, bytes_to_come: Optional[int]) -> bool:
        """Whether ``gathered`` pending bytes are worth holding for more (see Gathering): fewer
        than ``HPDL_GATHER_BYTES``, and fewer than the latest submitter says are still to come.
        Holding past the latter would only make the burst's last round bigger, and its
        transfer is what the caller waits for at the end."""
        return gathered < self.settings.gather_bytes and (bytes_to_come is None or gathered < bytes_to_come)

    def _pause(self, until: float) -> None:
        """Sleep until ``until`` (time.monotonic) or a reason for a round; finish the collectives
        in flight as the backend completes them, meanwhile and before the next round."""
        executor = self.executor
        while True:
            self._service()
            remaining = until - time.monotonic()
            if remaining <= 0 or self._round_wanted:
                break
            poll_s = executor.poll_interval_s()
            if poll_s:
                awaited = self._awaited
                urgent = awaited is not None and not awaited.poll()
                remaining = min(remaining, _AWAITED_POLL_INTERVAL_S if urgent else poll_s)
            self._wake.wait(remaining)
            self._wake.clear()
        self._round_wanted = False
        self._wake.clear()
        if self._collectives_done:  # done while the flags were being cleared
            self._collectives_done = False
            executor.complete()

    def _drain(self) -> int:
        """Move submitted requests to their process set's pending table; return how many."""
        queue = self._queue
        now = time.monotonic()
        count = len(queue)
        while queue:
            request = queue.popleft()
            request.arrival = now
            ps = self._sets.get(request.process_set_id)
            if ps is None:  # removed while the request waited in the queue
                request.handle.set_error(HorovodInternalError(
                    f"process set {request.process_set_id} was removed before {request.name!r} ran"))
                continue
            if ps.failed_groups and request.group in ps.failed_groups:
                left, message = ps.failed_groups[request.group]
                if left > 1:
                    ps.failed_groups[request.group] = (left - 1, message)
                else:
                    del ps.failed_groups[request.group]
                request.handle.set_error(HorovodInternalError(message))
                continue
            if request.kind is RequestKind.JOIN:
                self.executor.join_device = request.root  # where this rank's zeros go on a GPU
            ps.pending[request.name] = request
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
        room = self._room()
        tuner = self.autotuner
        tuning = tuner.word() if tuner is not None else TUNING_NONE
        result = world.controller.cycle(world.pending, flags, sets_pending, room, tuning)
        if result.shutdown:
            for ps in list(self._sets.values()):  # agreed on every rank: they start everywhere
                self._start_queued_of(ps, everything=True)
            self.executor.complete(block=True)  # started on every rank: they finish everywhere
            who = ranks_text(result.shutdown_by)  # never empty: the ranks that asked say so
            self._stop_message = f"hpdl has been shut down ({who} called hvd.shutdown(), or exited)"
            self._fail_pending(self._stop_message)
            return None
        if result.abort is not None:
            self._fail(result.abort, log_it=self.rank == 0)
            return None
        if result.tuning != self._tuning:
            self._retune(result.tuning)
        self._execute(world, result)
        if tuner is not None and tuner.active and result.responses:
            tuner.observe([r.name for r in result.responses if r.error is None],
                          sum(r.nbytes for r in result.responses if r.error is None))
        # Negotiations in flight (full exchanges, process sets with work) need every rank's
        # next round soon, even a rank with nothing of its own pending.
        self._hot = result.full or bool(result.sets_pending)
        ran = bool(result.responses)
        for set_id in sorted(self._sets):
            ps = self._sets.get(set_id)
            if set_id == 0 or ps is None or ps.controller is None:
                continue
            if set_id < 32 and not (result.sets_pending >> set_id) & 1 and not ps.backlog:
                continue
            sub = ps.controller.cycle(ps.pending, room=room)
            ran = ran or bool(sub.responses)
            self._hot = self._hot or sub.full
            if sub.abort is not None:  # a stall timeout within the set: the job is stuck as a whole
                self._end_job(sub.abort, stalled=not ps.pending)
                self._fail_set(ps, sub.abort)
                continue
            self._execute(ps, sub)
        backlogged = self._backlogged
        self._hot = self._hot or backlogged  # the backlog starts as room frees: rounds go on
        idle = self._idle = not backlogged and not any(ps.pending for ps in self._sets.values())
        if idle and self._queue:  # a submission raced the flag: do not sleep on it
            self._round_wanted = True
            self._wake.set()
        if self._timeline is not None and self._timeline.mark_cycles:
            self.bus.emit(ev.Event(ev.CYCLE, "cycle", (), ev.now_us(), rank=self.rank, cycle=self.cycles))
        return ran or self._hot

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
            self.executor.fusion_threshold = fusion_threshold
        if cycle_time_ms is not None:
            self._cycle_time_ms = cycle_time_ms
            self._cycle_s = cycle_time_ms / 1000.0

    def parameters(self) -> Dict[str, Any]:
        """The parameters the engine runs with now (autotuning changes them): the fusion
        threshold in bytes, the cycle time in ms, and whether rank 0 is still tuning (None on
        the other ranks)."""
        tuner = self.autotuner
        return {"fusion_threshold": self.executor.fusion_threshold, "cycle_time_ms": self._cycle_time_ms,
                "autotuning": (tuner.active if tuner is not None else False) if self.rank == 0 else None}

    def _execute(self, ps: ProcessSet, result: CycleResult) -> None:
        if not result.responses and not ps.backlog and not ps.queued:
            return
        requests: Dict[str, Request] = {}
        pending = ps.pending
        ready: List[Response] = []
        popped = [pending.pop(response.name, None) for response in result.responses]
        failed_groups = {request.group: response.error for response, request in zip(result.responses, popped)
                         if response.error is not None and request is not None and request.group is not None}
        if failed_groups:
            self._fail_groups(ps, failed_groups, popped)
        for response, request in zip(result.responses, popped):
            if (response.priority is not None and response.kind is RequestKind.ALLREDUCE
                    and response.error is None and response.group is None):
                ps.backlog.append((response, request))
                continue
            ready.append(response)
            if request is not None:
                requests[response.name] = request
        if ready:
            # What the round agreed runs after what earlier rounds queued, as on every rank
            # (only a paced set keeps a queue from one round to the next).
            self._start_queued_of(ps, everything=True)
            t = ev.now_us()
            now = time.monotonic()
            for response, request in zip(result.responses, popped):
                # When the engine thread took the request from its queue, on the wall clock.
                drained = t - (now - request.arrival) * 1e6 if request is not None else t
                self.bus.emit(ev.Event(ev.NEGOTIATED, response.kind.value, (response.name,), t, rank=self.rank,
                                       process_set_id=ps.id, cycle=self.cycles, drained_us=drained))
        # The executor emits DONE as each response completes (allreduces may finish rounds later).
        if ready:
            self.executor.run(ps.data_comm, ps.id, ready, requests, self.cycles, self._special)
        if ps.backlog:
            self._queue_from_backlog(ps, result.room)
        self._start_queued_of(ps, everything=not ps.paced)

    def _fail_groups(self, ps: ProcessSet, failed: Dict[Any, str], handled: List[Optional[Request]]) -> None:
        """A member of each group in ``failed`` failed in negotiation (group: error): fail the
        rest of this rank's members too, pending now or drained later. When the ranks disagree
        on a group's size, no other rank submits this rank's extra members; left pending, they
        would end the job at the stall timeout. Done before any handle of the round completes,
        so a caller that retries at once finds none of the old members in flight."""
        for group, message in failed.items():
            left = group[1] - sum(1 for request in handled if request is not None and request.group == group)
            for name in [name for name, request in ps.pending.items() if request.group == group]:
                ps.pending.pop(name).handle.set_error(HorovodInternalError(message))
                left -= 1
            if left > 0:
                ps.failed_groups[group] = (left, message)

    def _queue_from_backlog(self, ps: ProcessSet, room: int) -> None:
        """Queue the most urgent of ``ps.backlog`` that fit in the agreed ``room``: tensors of
        the in-place size alone, smaller ones together, to be fused."""
        self._queued_bytes += ps.queue_from_backlog(room, self._window, max(1, self.settings.inplace_threshold))

    def _special(self, response: Response, request: Optional[Request]) -> None:
        """Run the responses that change the engine itself: join and process-set changes."""
        handle = request.handle if request is not None else None
        if response.kind == RequestKind.JOIN:
            if handle is not None:
                handle.set_result(response.last_joined)
        elif response.kind == RequestKind.ADD_PROCESS_SET:
            ranks = list(response.signature[SIG_SPLITS])
            sub = self.comm.split(ranks)  # collective over every rank, in the agreed order
            set_id = self._next_set_id
            self._next_set_id += 1
            controller = self._controller(sub, set_id, ranks) if sub is not None else None
            added = ProcessSet(set_id, ranks, controller)
            self._pace(added)
            self._sets[set_id] = added
            if handle is not None:
                handle.set_result(set_id)
        elif response.kind == RequestKind.SPLIT_COMMUNICATOR:
            sub = self.comm.split(list(response.signature[SIG_SPLITS]))  # collective, in the agreed order
            if handle is not None:
                handle.set_result(sub)
            elif sub is not None:
                sub.close()
        elif response.kind == RequestKind.REMOVE_PROCESS_SET:
            set_id = response.signature[SIG_ROOT]
            ps = self._sets.pop(set_id, None)
            if ps is not None:
                self._fail_set(ps, f"process set {set_id} was removed")
                if ps.controller is not None:
                    ps.controller.comm.close()
            if handle is not None:
                handle.set_result(set_id)

    # -- failure ---------------------------------------------------------------------------
