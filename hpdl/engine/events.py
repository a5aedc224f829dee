"""The engine's event stream: one timestamped event per phase of each request.

Observers (the timeline, the profiler, tools of your own) receive every :class:`Event` the
engine emits. Subscribe with :func:`subscribe`: the subscription is process-wide, so it holds
across ``hvd.shutdown()`` / ``hvd.init()`` (every engine started later delivers to it too)
until :func:`unsubscribe`. An observer is called on the thread that emits (the engine thread,
or the training thread for ``QUEUED`` and ``STEP``), must be quick and thread-safe, and must
not call collectives. An observer that raises is reported once per process (a warning on the
``hpdl.engine.events`` logger, with its traceback), however many engines it sees, and keeps
receiving events; it never breaks a collective. When no observer is subscribed,
:attr:`EventBus.active` is False and the engine does not even build the events.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from typing import Callable, List, Optional, Tuple

log = logging.getLogger("hpdl.engine.events")

# Phases, in the order a request passes through them.
QUEUED = "QUEUED"
NEGOTIATED = "NEGOTIATED"
MEMCPY_IN = "MEMCPY_IN_FUSION_BUFFER"
COLLECTIVE = "COLLECTIVE"
MEMCPY_OUT = "MEMCPY_OUT_FUSION_BUFFER"
DONE = "DONE"
CYCLE = "CYCLE"
# A training step ended (DistributedOptimizer.step() or hvd.profile_step()).
STEP = "STEP"

# Kinds of the COLLECTIVE events that a spatial group's communicator emits on the thread that
# runs the model, outside the engine (hpdl.torch.spatial.comm): no queue, negotiation or
# fusion, the names the layer's path. Observers that follow the engine's phases keep them apart.
HALO = "halo"  # a halo exchange with the neighbour bands (op SENDRECV)
SPATIAL = "spatial"  # a spatial group's allreduce or allgather (batch norm, global pooling, gather)
GROUP_KINDS = (HALO, SPATIAL)


@dataclasses.dataclass(frozen=True)
class Event:
    """One phase of one or several requests.

    ``time_us`` is microseconds since the epoch (wall clock, comparable across ranks up to
    clock skew); ``duration_us`` is 0 for instants. ``names`` lists the tensors covered (a
    fused collective covers several, ``fused`` of them). ``op`` names the backend call, e.g.
    ``MPI_ALLREDUCE``, and ``backend`` the backend (``mpi``, ``gloo``, ``nccl``); ``nbytes``
    is the message size the backend sees, ``sizes`` the bytes of each tensor in it (on
    ``COLLECTIVE`` events) and ``dtype`` their element type; ``cycle`` counts engine cycles.
    On ``NEGOTIATED`` events ``drained_us`` is when the engine thread took the request from
    its queue. On ``STEP`` events ``duration_us`` is the time the process spent blocked on
    unfinished collectives since the previous step.
    """

    phase: str
    kind: str
    names: Tuple[str, ...]
    time_us: float
    duration_us: float = 0.0
    nbytes: int = 0
    op: str = ""
    rank: int = 0
    process_set_id: int = 0
    cycle: int = 0
    fused: int = 1
    sizes: Tuple[int, ...] = ()
    dtype: str = ""
    backend: str = ""
    drained_us: float = 0.0


Observer = Callable[[Event], None]


def now_us() -> float:
    """Wall-clock microseconds since the epoch."""
    return time.time() * 1e6


# Process-wide subscriptions and the buses that deliver to them.
_subscribers: List[Observer] = []
_buses: "weakref.WeakSet[EventBus]" = weakref.WeakSet()
_registry_lock = threading.Lock()
# Observers whose failure was reported, compared by equality as _subscribers are (a bound
# method is a new object at each access). Process-wide, since every init() makes a new bus;
# an observer leaves it when it is unsubscribed or removed.
_reported: List[Observer] = []
_reported_lock = threading.Lock()


def _forget_reported(observer: Observer) -> None:
    with _reported_lock:
        _reported[:] = [o for o in _reported if o != observer]


def subscribe(observer: Observer) -> None:
    """Deliver every event of this process's engines, present and future, to ``observer``."""
    with _registry_lock:
        if observer in _subscribers:  # equality: a bound method is a new object at each access
            return
        _subscribers.append(observer)
        for bus in list(_buses):
            bus._refresh()


def unsubscribe(observer: Observer) -> None:
    """Stop delivering events to ``observer`` (subscribed with :func:`subscribe`)."""
    with _registry_lock:
        _subscribers[:] = [o for o in _subscribers if o != observer]
        for bus in list(_buses):
            bus._refresh()
    _forget_reported(observer)


class EventBus:
    """Fan events out to observers; costs one attribute check when nobody listens.

    Delivers to the process-wide subscribers and to observers added to this bus alone with
    :meth:`add` (an engine's own timeline).
    """

    def __init__(self) -> None:
        self._own: List[Observer] = []
        self._observers: List[Observer] = []
        self.active = False
        with _registry_lock:
            _buses.add(self)
            self._refresh()

    def _refresh(self) -> None:
        # Replaced, never mutated: emit() iterates without a lock.
        self._observers = list(_subscribers) + self._own
        self.active = bool(self._observers)

    def add(self, observer: Observer) -> None:
        """Deliver this bus's events to ``observer`` too."""
        with _registry_lock:
            self._own = self._own + [observer]
            self._refresh()

    def remove(self, observer: Observer) -> None:
        """Stop delivering to an observer given to :meth:`add`."""
        with _registry_lock:
            self._own = [o for o in self._own if o != observer]
            self._refresh()
        _forget_reported(observer)

    def emit(self, event: Event) -> None:
        """Call every observer with ``event``; an observer's failure is logged once, not raised."""
        for observer in self._observers:
            try:
                observer(event)
            except Exception:  # an observer must never break a collective
                _report(observer)

    def observers(self) -> List[Observer]:
        return list(self._observers)


def _report(observer: Observer) -> None:
    """Log the failure being handled, the first time ``observer`` fails in this process."""
    with _reported_lock:
        if observer in _reported:
            return
        _reported.append(observer)
    log.warning("event observer %r failed (reported once; it keeps receiving events)", observer, exc_info=True)


class WaitMeter:
    """Seconds this process's threads spent blocked on unfinished handles, while enabled.

    Handles add to it only on their blocking path, and only when a profile enabled it.
    """

    __slots__ = ("enabled", "blocked_s")

    def __init__(self) -> None:
        self.enabled = False
        self.blocked_s = 0.0

    def take(self) -> float:
        """Return the seconds blocked since the last call, and start counting afresh."""
        blocked, self.blocked_s = self.blocked_s, 0.0
        return blocked


WAITS = WaitMeter()


def mark_step(bus: EventBus, rank: int) -> None:
    """Emit a STEP event carrying the time blocked on collectives since the previous step."""
    if bus.active:
        bus.emit(Event(STEP, "step", (), now_us(), duration_us=WAITS.take() * 1e6, rank=rank))


class Span:
    """Time a phase: ``with bus_span(...)`` emits one event with its duration on exit."""

    __slots__ = ("bus", "fields", "start")

    def __init__(self, bus: EventBus, **fields):
        self.bus = bus
        self.fields = fields
        self.start: Optional[float] = None

    def __enter__(self) -> "Span":
        if self.bus.active:
            self.start = now_us()
        return self

    def __exit__(self, *exc) -> None:
        if self.start is not None:
            end = now_us()
            self.bus.emit(Event(time_us=self.start, duration_us=end - self.start, **self.fields))
