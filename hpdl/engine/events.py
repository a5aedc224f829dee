"""The engine's event stream: one timestamped event per phase of each request.

Observers (the timeline, the profiler) subscribe with :meth:`EventBus.add`; when none is
subscribed, :attr:`EventBus.active` is False and the engine does not even build the events.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, List, Optional, Tuple

# Phases, in the order a request passes through them.
QUEUED = "QUEUED"
NEGOTIATED = "NEGOTIATED"
MEMCPY_IN = "MEMCPY_IN_FUSION_BUFFER"
COLLECTIVE = "COLLECTIVE"
MEMCPY_OUT = "MEMCPY_OUT_FUSION_BUFFER"
DONE = "DONE"
CYCLE = "CYCLE"


@dataclasses.dataclass(frozen=True)
class Event:
    """One phase of one or several requests.

    ``time_us`` is microseconds since the epoch (wall clock, comparable across ranks up to
    clock skew); ``duration_us`` is 0 for instants. ``names`` lists the tensors covered (a
    fused collective covers several). ``op`` names the backend call, e.g. ``MPI_ALLREDUCE``;
    ``nbytes`` is the message size; ``step`` counts engine cycles.
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


Observer = Callable[[Event], None]


def now_us() -> float:
    """Wall-clock microseconds since the epoch."""
    return time.time() * 1e6


class EventBus:
    """Fan events out to observers; costs one attribute check when nobody listens."""

    def __init__(self) -> None:
        self._observers: List[Observer] = []
        self._lock = threading.Lock()
        self.active = False

    def add(self, observer: Observer) -> None:
        with self._lock:
            self._observers = self._observers + [observer]
            self.active = True

    def remove(self, observer: Observer) -> None:
        with self._lock:
            self._observers = [o for o in self._observers if o is not observer]
            self.active = bool(self._observers)

    def emit(self, event: Event) -> None:
        for observer in self._observers:
            try:
                observer(event)
            except Exception:  # an observer must never break a collective
                pass

    def observers(self) -> List[Observer]:
        return list(self._observers)


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
