"""Clocks for engine tests (hpdl/engine/clock.py): time passes only when the test says.

``FakeClock`` is a time the test sets, for the scheduling policy alone. ``ManualClock`` drives
an engine thread: the thread's waits end only when the test lets their time pass (``advance``)
or when their event is set (a submission, a waiter), so what the engine does at each moment is
the same on every run, however loaded the machine.
"""

import threading
import time

_SETTLE_LIMIT_S = 30.0  # real seconds an engine thread may take to reach its next wait


class FakeClock:
    """A time the test sets (``now``); nothing may wait on it."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def wait(self, event, timeout):
        raise AssertionError("the policy never waits; the engine thread does (use ManualClock)")


class ManualClock:
    """Time that stands still while the engine thread works, and passes when the test says.

    The engine thread's ``wait(event, timeout)`` returns when ``event`` is set or once the test
    has moved the time to its end (``advance``); until then the thread is "settled" (blocked,
    nothing for it to do). The real waiting in between polls the event every millisecond, as
    ``Event.set`` cannot notify a condition.
    """

    def __init__(self, now: float = 1000.0):
        self._now = now
        self._cond = threading.Condition()
        self._deadline = None  # the end of the wait the engine thread is in, if any
        self._event = None

    def monotonic(self) -> float:
        return self._now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        with self._cond:
            deadline = self._now + timeout
            self._deadline, self._event = deadline, event
            self._cond.notify_all()
            try:
                while not event.is_set() and self._now < deadline:
                    self._cond.wait(0.001)
            finally:
                self._deadline = self._event = None
                self._cond.notify_all()
            return event.is_set()

    def _settled(self) -> bool:
        return self._deadline is not None and self._now < self._deadline and not self._event.is_set()

    def settle(self) -> None:
        """Return once the engine thread waits for a time to come or an event (real time)."""
        give_up = time.monotonic() + _SETTLE_LIMIT_S
        with self._cond:
            while not self._settled():
                if time.monotonic() > give_up:
                    raise AssertionError(f"the engine thread did not reach a wait in {_SETTLE_LIMIT_S:g} s")
                self._cond.wait(0.001)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass: each of the engine thread's waits that ends by then ends at its
        time, in turn; return settled, the clock ``seconds`` later than before."""
        target = self._now + seconds
        while True:
            self.settle()
            with self._cond:
                if self._deadline > target:
                    self._now = target
                    return
                self._now = self._deadline
                self._cond.notify_all()

    def advance_until(self, done, step: float = 0.001, limit: float = 10.0) -> None:
        """Let time pass ``step`` by ``step`` until ``done()`` is true (at most ``limit`` seconds)."""
        passed = 0.0
        while not done():
            if passed >= limit:
                raise AssertionError(f"not done after {limit:g} s of the clock's time")
            self.advance(step)
            passed += step
