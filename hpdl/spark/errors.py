"""What ``hpdl.spark.run`` raises on the driver when the ranks cannot start or do not all return."""

from __future__ import annotations

from typing import List, Optional


class SparkRunError(RuntimeError):
    """The run did not give every rank's result (Spark failed the job, or a rank failed)."""


class SlotsUnavailableError(SparkRunError):
    """Spark did not start every rank's task within the start timeout: too few free task slots.

    Attributes:
        wanted: the task slots the run needs at once (``num_proc``).
        found: the slots free when the timeout ended.
        total: every slot of the cluster's executors, busy or not.
    """

    def __init__(self, message: str, wanted: int, found: int, total: int) -> None:
        super().__init__(message)
        self.wanted, self.found, self.total = wanted, found, total


class RankFailedError(SparkRunError):
    """A rank did not return: it raised, exited, was killed or could not start.

    Attributes:
        rank: the first rank that failed (others that failed after it are named in the message).
        host: the node it ran on.
        exit_code: its exit status, or None when a signal ended it or it never started.
        signal: the signal that ended it, or None.
        traceback: the text of its exception's traceback, when it raised one.
        exception_type: its exception's class as the traceback names it (``RuntimeError``,
            ``hpdl.engine.errors.HorovodInternalError``), when it raised one.
        exception_message: its exception's message, when it raised one.
        tail: the last lines it wrote to stderr.

    The first rank that failed is the one whose own code raised, exited or was killed: the
    others' HorovodInternalError that follows it ("hpdl has been shut down") is named after it.
    """

    def __init__(self, message: str, rank: int, host: str, exit_code: Optional[int], signal: Optional[int],
                 traceback: Optional[str], tail: List[str], exception_type: Optional[str] = None,
                 exception_message: Optional[str] = None) -> None:
        super().__init__(message)
        self.rank, self.host, self.exit_code, self.signal = rank, host, exit_code, signal
        self.traceback, self.tail = traceback, tail
        self.exception_type, self.exception_message = exception_type, exception_message
