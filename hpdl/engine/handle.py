"""Handles: what an asynchronous call returns, completed by the engine thread."""

from __future__ import annotations

import _thread
import time
from typing import Any, Callable, List, Optional

from hpdl.engine.blocked import BLOCKED, Wait
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.events import WAITS


class Handle:
    """The pending result of one request; ``poll`` and ``wait`` are safe from any thread.

    Built on a bare lock, held until completion: a handle is created per tensor per step, and
    a ``threading.Event`` costs ten times as much to create.
    """

    __slots__ = ("name", "_lock", "_result", "_error", "_callbacks", "_registry", "_key", "_on_wait")

    def __init__(self, name: str, registry: Optional[set] = None, key: Any = None,
                 on_wait: Optional[Callable[["Handle"], None]] = None):
        """Args:
            registry, key: ``key`` is removed from the set ``registry`` just before the handle
                completes (the engine's names in flight), so a waiter can reuse the name at once.
            on_wait: called with the handle when a caller starts blocking on it unfinished (the
                engine then stops pacing its cycles down, and polls what it waits for often).
        """
        self.name = name
        self._on_wait = on_wait
        self._registry = registry
        self._key = key
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: Optional[List[Callable[["Handle"], None]]] = None

    def poll(self) -> bool:
        """Return True once the result (or an error) is available."""
        return not self._lock.locked()

    def wait_done(self, timeout: Optional[float] = None) -> None:
        """Block until done, neither returning the result nor raising its error."""
        if self._lock.locked():
            if self._on_wait is not None:
                self._on_wait(self)
            started = time.perf_counter() if WAITS.enabled else None  # a profile counts exposed waits
            # Registered while it blocks, for negotiation's search for waits that can never end (blocked.py).
            blocked = BLOCKED.begin(Wait(self.name.__str__, BLOCKED.submissions, request=self._key)) \
                if self._key is not None else None
            try:
                if not self._lock.acquire(True, -1 if timeout is None else timeout):
                    raise TimeoutError(f"collective {self.name!r} still in flight after {timeout} s")
            finally:
                if blocked is not None:
                    BLOCKED.end(blocked)
            self._lock.release()
            if started is not None:
                WAITS.blocked_s += time.perf_counter() - started

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done; return the result or raise the request's error."""
        self.wait_done(timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(handle)`` when done (at once if already done), on the completing thread.

        Register callbacks before the handle can complete (the engine registers its own before
        queueing the request); one registered later than completion runs at once.
        """
        if not self._lock.locked():
            fn(self)
            return
        if self._callbacks is None:
            self._callbacks = [fn]
        else:
            self._callbacks.append(fn)

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_error(self, error: BaseException) -> None:
        if not isinstance(error, HorovodInternalError):
            wrapped = HorovodInternalError(f"{self.name}: {error}")
            wrapped.__cause__ = error
            error = wrapped
        self._finish(None, error)

    def _finish(self, result: Any, error: Optional[BaseException]) -> None:
        if not self._lock.locked():
            return  # completed already (an error racing a result): the first one stands
        self._result, self._error = result, error
        if self._registry is not None:
            self._registry.discard(self._key)
        callbacks, self._callbacks = self._callbacks, None
        if callbacks:
            for fn in callbacks:
                fn(self)
        self._lock.release()
