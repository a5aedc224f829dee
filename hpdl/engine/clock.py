"""The engine's clock: where its decisions read the time and its thread waits.

One clock, handed to the Engine, serves everything that decides by time: the scheduling
policy (scheduling.py), the engine thread's pauses, negotiation's stall checks and the watch
of rounds and collectives that take too long. A test hands in a clock of its own, whose time
passes only when the test says, and then checks what the engine decides at each moment
instead of asserting durations around real sleeps. The timestamps of events (events.py) are
wall-clock times for observers, not decisions, and do not come from here.
"""

from __future__ import annotations

import threading
import time


class Clock:
    """The system's monotonic clock (the one an engine uses unless handed another)."""

    # The functions themselves, not methods that call them: the engine thread reads the time on
    # every round and every wake-up, and waits in every pause.
    monotonic = staticmethod(time.monotonic)
    # wait(event, timeout): wait until ``event`` is set or ``timeout`` seconds have passed;
    # return whether it is set.
    wait = staticmethod(threading.Event.wait)


SYSTEM_CLOCK = Clock()
