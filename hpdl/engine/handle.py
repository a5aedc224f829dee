"""Handles: what an asynchronous call returns, completed by the engine thread."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from hpdl.engine.errors import HorovodInternalError


class Handle:
    """The pending result of one request; ``poll`` and ``wait`` are safe from any thread."""

    __slots__ = ("name", "_done", "_result", "_error", "_callbacks", "_lock")

    def __init__(self, name: str):
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: list = []
        self._lock = threading.Lock()

    def poll(self) -> bool:
        """Return True once the result (or an error) is available."""
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done; return the result or raise the request's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"collective {self.name!r} still in flight after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(handle)`` when done (at once if already done), on the completing thread."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_error(self, error: BaseException) -> None:
        if not isinstance(error, HorovodInternalError):
            wrapped = HorovodInternalError(f"{self.name}: {error}")
            wrapped.__cause__ = error
            error = wrapped
        self._finish(None, error)

    def _finish(self, result: Any, error: Optional[BaseException]) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._result, self._error = result, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
