"""Errors raised by the engine to callers."""

from typing import FrozenSet, Tuple


class HorovodInternalError(RuntimeError):
    """A collective failed on this rank: mismatched requests, a stalled or dead rank, a backend error.

    Named as in Horovod, so that scripts catching ``hvd.HorovodInternalError`` keep working.
    """


class NegotiationError(HorovodInternalError):
    """A collective the members agreed not to run, raised on every member: their requests of
    its name differ, or it cannot run after some of them joined.

    Attributes:
        kinds: the kinds of request (``RequestKind`` values) the members submitted under the name.
        joined: the members that had joined and submitted nothing.
    """

    def __init__(self, message: str, kinds: FrozenSet[str] = frozenset(), joined: Tuple[int, ...] = ()):
        super().__init__(message)
        self.kinds = kinds
        self.joined = joined

    def with_advice(self, advice: str) -> "NegotiationError":
        """The same error, its message followed by ``advice`` (the caller's words on what to change)."""
        return NegotiationError(f"{self} {advice}", self.kinds, self.joined)
