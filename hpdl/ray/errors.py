"""What ``hpdl.ray`` raises: each error's message is one line that names what went wrong."""

from __future__ import annotations

from typing import Optional


class RayMissingError(ImportError):
    """Ray is not installed."""

    def __init__(self) -> None:
        super().__init__('hpdl.ray needs Ray: pip install "hpdl[ray]"')


class PlacementError(RuntimeError):
    """The cluster cannot hold the workers asked for (within the settings' timeout)."""


class WorkerFailedError(RuntimeError):
    """A rank's function raised, or its actor or node died; ``rank`` names it (None: unknown)."""

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


def first_line(err: Optional[BaseException]) -> str:
    """The first line of an error's message (its type's name where it has none)."""
    text = str(err).strip() if err is not None else ""
    return text.splitlines()[0] if text else type(err).__name__
