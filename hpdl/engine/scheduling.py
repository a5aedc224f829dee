"""The engine's scheduling policy: when its thread runs a round, when it holds one back to
gather more allreduces, and which prioritized allreduces it queues and starts.

Pacing. A round is a collective exchange: every member's engine thread must take part, and on
a machine whose cores are all busy computing (data-parallel training), each round costs CPU
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
A request submitted to an idle engine thus still starts a round at once (unless it is
gathered, below), and the cycle time bounds the latency of a collective whose ranks are all
ready; one that a peer idle for long has not submitted waits for that peer's timer (at most
``_IDLE_PAUSE_MAX_S``) to learn that it cannot run yet.

Gathering. Each round costs every rank CPU time (the negotiation, then starting the agreed
collectives), whatever it agrees. Backward makes gradients one layer at a time, milliseconds
apart; a round per gradient is a round and a backend call per tensor, which on CPU-bound nodes
comes out of the compute (measured: docs/perf-notes/). So while every request pending is an
allreduce that no caller waits for yet, the engine gathers instead of running a round: until
``HPDL_GATHER_BYTES`` of them are pending (a fused message worth a round), the oldest has
waited ``HPDL_GATHER_TIME``, a caller starts waiting for one (the optimizer's step, a
synchronous call), or as many bytes are pending as the latest submission says are still to
come (``Request.bytes_to_come``), whichever comes first. The last rule is for the end of a
step: whatever is held when backward ends is transferred while the optimizer waits, so the
held bytes halve as the step's last gradients arrive (the optimizer knows how many bytes are
left) and the last round carries about one gradient, as without gathering. Every rank gathers
by the same rule over the same tensors, so the ranks reach their rounds together.

Priorities. An allreduce submitted with a priority (DistributedOptimizer does so when the next
forward overlaps the gradients' exchange: the first layers' gradients are needed first, but
backward makes them last) is not started as soon as it is agreed: it waits in its process
set's backlog, and each round queues the backlog's most urgent allreduces that fit in the
room every member has left in its window of ``HPDL_PRIORITY_WINDOW`` bytes in flight or
queued (the room travels in the negotiation, so every rank queues the same ones in the same
order). Each rank starts its queue in that order as its window frees (half of it in flight
where collectives progress side by side, as MPI's do; see :meth:`Scheduler.pacing`), without
waiting for a round: between rounds, and while a round waits (the backend calls back,
``Communicator.control_wait_hook``), since over TCP a round's control message can queue
behind megabytes of data and a late peer can hold a round for milliseconds, during which the
link would otherwise run dry. A round's own collectives start after everything queued
before them, so every rank starts the same collectives in the same order. What is still in
the backlog can be overtaken; what is queued or started, cannot, so the window is kept
small, just enough to keep the network busy.

The :class:`Scheduler` holds this policy's state on one rank and decides; the engine thread
(engine.py) acts on its decisions: it runs the round, pauses, starts the allreduce, and a
process set's backlog (process_set.py) queues what the scheduler chose. Each decision is a
function of that state, of what the engine tells it (:meth:`Scheduler.after_round`) and of the
time on the clock it was handed (clock.py), so tests drive it directly, on a clock of their
own.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

from hpdl.config import Settings
from hpdl.engine.clock import SYSTEM_CLOCK, Clock
from hpdl.engine.handle import Handle
from hpdl.engine.negotiation import ROOM_UNITS
from hpdl.engine.process_set import Agreed, ProcessSetState, QueuedBatch
from hpdl.engine.request import Request, RequestKind, Response

_BUSY_PAUSE_CAP_S = 0.005  # longest pause between fruitless rounds while this rank has requests pending
# Pauses of a rank with nothing pending (its own submissions wake it at once): the first, and
# the longest they double to while its rounds agree nothing (each costs the compute CPU time).
_IDLE_PAUSE_MIN_S = 0.02
_IDLE_PAUSE_MAX_S = 0.1
_FRUITLESS_MAX = 30  # fruitless rounds counted at most (the doubling's exponent)
# How often collectives that move only when polled (MPI over TCP) are polled while a caller
# waits for a result: its core is idle then, and every protocol step the backend takes only
# when called (a rendezvous, a reduction) would otherwise wait for the next poll. Otherwise
# they are polled as often as the backend asks (InFlight.poll_interval_s).
_AWAITED_POLL_INTERVAL_S = 5e-5


class Scheduler:
    """The scheduling policy's state on this rank, and its decisions (see the module's doc).

    Its fields change only through its methods; others read them. ``idle`` and ``gathering``
    are read, and ``gathered`` counted, by submitting threads without a lock
    (:meth:`round_for_submission`): single attribute reads and writes, atomic under the GIL,
    so that a submission never waits for the engine thread.
    """

    def __init__(self, settings: Settings, clock: Clock = SYSTEM_CLOCK):
        self.clock = clock
        self.cycle_time_ms = settings.cycle_time_ms  # autotuning changes it (set_cycle_time)
        self.cycle_s = settings.cycle_time_ms / 1000.0
        self._gather_bytes = settings.gather_bytes
        self._gather_time_s = settings.gather_time_ms / 1000.0
        self.window = settings.priority_window
        # Queued prioritized allreduces of this size or more start alone, smaller ones fused.
        self._alone = max(1, settings.inplace_threshold)
        # Pacing
        self.idle = True  # nothing pending on this rank: a submission wants a round at once
        self.hot = False  # the last round started a negotiation that needs quick rounds
        self.fruitless = 0  # consecutive rounds that agreed nothing with no new local request
        self.idle_pause = _IDLE_PAUSE_MIN_S  # the next pause of an idle rank
        self.awaited: Optional[Handle] = None  # the handle a caller last started waiting for
        # Gathering
        self.gathering = False  # holding the next round back: submissions are counted
        self.gathered = 0  # while gathering: the bytes pending

    def set_cycle_time(self, cycle_time_ms: float) -> None:
        """Pace rounds at ``cycle_time_ms`` from now on (rank 0's autotuner chose it)."""
        self.cycle_time_ms = cycle_time_ms
        self.cycle_s = cycle_time_ms / 1000.0

    # -- submissions and waiters (from the callers' threads) --------------------------------

    def round_for_submission(self, request: Request) -> bool:
        """Whether ``request``, just submitted, calls for a round now (the engine is woken).

        An idle engine runs one at once. A gathering engine counts the request here, so that it
        sleeps through the submissions of a gathering (a wake-up per gradient would cost the
        compute a thread switch each), and wants its round once the gathering is not worth
        holding any more or the request is not an allreduce.
        """
        if self.idle:
            self.idle = False
            return True
        if self.gathering:
            gathered = self.gathered = self.gathered + request.nbytes
            return (request.kind is not RequestKind.ALLREDUCE
                    or not self.worth_holding(gathered, request.bytes_to_come))
        return False

    def round_for_waiter(self, handle: Optional[Handle]) -> bool:
        """A caller starts waiting for ``handle``: remember it (what is in flight is then polled
        often, :meth:`wait_s`), and return whether the next round should come now: a doubled
        pause or a gathering is cut short, the cycle time still bounds the rest."""
        self.awaited = handle
        if self.fruitless or self.gathering:
            self.fruitless = 0
            return True
        return False

    # -- pacing ----------------------------------------------------------------------------

    def after_round(self, hot: bool, idle: bool) -> None:
        """What the round just run left: whether the rounds must follow at the cycle time
        (``hot``: a full exchange or a process set with work is under way, or a backlog is
        waiting to start as room frees), and whether nothing is pending on this rank
        (``idle``: the next submission wakes the engine)."""
        self.hot = hot
        self.idle = idle

    def next_round_at(self, started: float, progressed: bool, arrived: int) -> float:
        """When the next round is due, after one that started at ``started`` (clock time).

        Args:
            progressed: the round ran something, or must be followed soon (``hot``).
            arrived: requests this rank took from its queue just before the round.
        """
        cycle_s = self.cycle_s
        if self.idle:
            # Nothing pending here: the next local submission wakes the engine. Peers with work
            # wait for this rank's next round, which they get at once if they submit the same
            # tensors (the data-parallel case) and within the idle pause otherwise; it grows
            # while the rounds find nothing to do (in training: the forward), as each costs
            # the compute CPU time.
            self.fruitless = 0
            if progressed:
                self.idle_pause = _IDLE_PAUSE_MIN_S
            pause = cycle_s if self.hot else max(self.idle_pause, cycle_s)
            if not progressed:
                self.idle_pause = min(2 * self.idle_pause, _IDLE_PAUSE_MAX_S)
        elif progressed or arrived:
            self.fruitless = 0
            pause = cycle_s
        else:
            self.fruitless = fruitless = min(self.fruitless + 1, _FRUITLESS_MAX)
            pause = min(cycle_s * (1 << fruitless), max(_BUSY_PAUSE_CAP_S, cycle_s))
        return started + pause

    def wait_s(self, until: float, poll_s: float) -> float:
        """How long the engine thread may wait now in a pause that ends at ``until``: to its
        end, or to the next poll of the collectives in flight (``poll_s``; 0: none needs
        polling), sooner while a caller waits for a result. 0 or less: the pause is over."""
        remaining = until - self.clock.monotonic()
        if remaining > 0 and poll_s:
            awaited = self.awaited
            urgent = awaited is not None and not awaited.poll()
            remaining = min(remaining, _AWAITED_POLL_INTERVAL_S if urgent else poll_s)
        return remaining

    # -- gathering -------------------------------------------------------------------------

    def gather_until(self, sets: Iterable[ProcessSetState], backlogged: bool, shutting_down: bool,
                     stall_check_s: float) -> Optional[float]:
        """Until when (clock time) to hold the next round back to gather more allreduces, or
        None to run it now. From a time on, the engine is gathering (:meth:`end_gathering`).

        Args:
            sets: the process sets, whose pending requests are looked at.
            backlogged: some prioritized allreduce is agreed but not started yet.
            shutting_down: this rank asked every rank to stop.
            stall_check_s: how long a request may wait before a round must check for stalls
                (negotiation.py); no gathering lasts longer.
        """
        if not self._gather_bytes or shutting_down or self.hot or backlogged:
            return None
        awaited = self.awaited
        if awaited is not None and not awaited.poll():
            return None
        pending_bytes = 0
        oldest = newest = None
        allreduce = RequestKind.ALLREDUCE
        for ps in sets:
            for request in ps.pending.values():
                if request.kind is not allreduce:
                    return None
                pending_bytes += request.nbytes
                if oldest is None or request.arrival < oldest:
                    oldest = request.arrival
                if newest is None or request.arrival >= newest.arrival:
                    newest = request
        if oldest is None or not self.worth_holding(pending_bytes, newest.bytes_to_come):
            return None
        until = oldest + min(self._gather_time_s, stall_check_s)
        if until <= self.clock.monotonic():
            return None
        self.gathered = pending_bytes
        self.gathering = True
        self.idle = False  # submissions are counted (round_for_submission) rather than each waking the engine
        return until

    def end_gathering(self) -> None:
        self.gathering = False

    def worth_holding(self, gathered: int, bytes_to_come: Optional[int]) -> bool:
        """Whether ``gathered`` pending bytes are worth holding for more: fewer than
        ``HPDL_GATHER_BYTES``, and fewer than the latest submitter says are still to come.
        Holding past the latter would only make the burst's last round bigger, and its
        transfer is what the caller waits for at the end."""
        return gathered < self._gather_bytes and (bytes_to_come is None or gathered < bytes_to_come)

    # -- priorities ------------------------------------------------------------------------

    def pacing(self, data_comm: Any, background: bool) -> Tuple[bool, int]:
        """How the queued allreduces of a process set whose collectives run on ``data_comm``
        start (``background``: the executor keeps collectives in flight): whether they start
        between rounds, as room frees, and how many of their bytes may be in flight at once.

        Between rounds only where they run in the background: a blocking call started outside
        the agreed order of rounds could wait for a peer blocked in another process set's
        collective. Where they progress side by side (MPI), half the window is in flight and
        half queued, so that the urgent ones are not slowed by many others sharing the network;
        where they run in order (gloo, nccl) the backend's own queue does that, and the whole
        window is in flight."""
        paced = background and bool(getattr(data_comm, "background_collectives", False))
        in_order = getattr(data_comm, "runs_in_order", True)
        return paced, self.window if in_order else max(1, self.window // 2)

    def room(self, in_flight_bytes: int, queued_bytes: int) -> int:
        """This rank's room for prioritized allreduces, in units of the window (``ROOM_UNITS``
        make a whole one): what is in flight and what is queued to start (in every process
        set's backlog) counts against it."""
        used = in_flight_bytes + queued_bytes
        if used <= 0:
            return ROOM_UNITS
        return max(0, self.window - used) * ROOM_UNITS // self.window

    def batches_to_queue(self, urgent_first: List[Agreed], room: int) -> List[QueuedBatch]:
        """Which of a backlog (``urgent_first``: most urgent first) to queue in ``room`` units
        (agreed by every member, so every rank queues the same, in the same order): the first
        ones that fit, as batches to start: tensors of the in-place size or more each alone,
        smaller ones together, to be fused."""
        budget = room * self.window // ROOM_UNITS
        taken, used = 0, 0
        for response, _ in urgent_first:
            # A window empty on every rank takes the next one whatever its size.
            if used + response.nbytes > budget and not (taken == 0 and room == ROOM_UNITS):
                break
            used += response.nbytes
            taken += 1
        alone = self._alone
        batches: List[QueuedBatch] = []
        batch: List[Response] = []
        requests: Dict[str, Request] = {}
        nbytes = 0
        for response, request in urgent_first[:taken]:
            if response.nbytes >= alone and batch:
                batches.append(QueuedBatch(batch, requests, nbytes))
                batch, requests, nbytes = [], {}, 0
            batch.append(response)
            nbytes += response.nbytes
            if request is not None:
                requests[response.name] = request
            if nbytes >= alone:
                batches.append(QueuedBatch(batch, requests, nbytes))
                batch, requests, nbytes = [], {}, 0
        if batch:
            batches.append(QueuedBatch(batch, requests, nbytes))
        return batches

    def may_start(self, in_flight_bytes: int, nbytes: int, flight_window: int) -> bool:
        """Whether a queued batch of ``nbytes`` may start between rounds: it fits in the flight
        window beside what is in flight, or nothing is in flight."""
        return in_flight_bytes <= 0 or in_flight_bytes + nbytes <= flight_window
