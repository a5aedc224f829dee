"""One process set as the engine sees it on this rank: its negotiation, the requests pending
in it, and its backlog of prioritized allreduces agreed but not started yet (see
scheduling.py, Priorities, for which of them are queued and when they start).

Each class here changes its own state through its methods: the engine thread admits, takes and
fails requests; the scheduler only decides (which of the backlog to queue, whether a queued
batch may start) and the backlog applies its decisions.
"""

from __future__ import annotations

import collections
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from hpdl.comm import Communicator
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.negotiation import Controller
from hpdl.engine.request import Request, Response

Agreed = Tuple[Response, Optional[Request]]  # an agreed response and this rank's request (None: joined)


class QueuedBatch(NamedTuple):
    """Prioritized allreduces queued to start together: their responses, this rank's requests by
    name, and their bytes."""

    responses: List[Response]
    requests: Dict[str, Request]
    nbytes: int


class Backlog:
    """A process set's prioritized allreduces agreed but not started: those waiting for room, and
    those queued, in an agreed order, to start as this rank's window has room, with the bytes
    queued (they count against the window, Scheduler.room)."""

    def __init__(self) -> None:
        self._waiting: List[Agreed] = []
        self._queued: "collections.deque[QueuedBatch]" = collections.deque()
        self.queued_bytes = 0

    @property
    def waiting(self) -> int:
        """How many agreed allreduces wait for room."""
        return len(self._waiting)

    @property
    def queued(self) -> int:
        """How many batches are queued to start."""
        return len(self._queued)

    def add(self, response: Response, request: Optional[Request]) -> None:
        """``response`` was agreed: it waits for room."""
        self._waiting.append((response, request))

    def queue(self, room: int, choose: Callable[[List[Agreed], int], List[QueuedBatch]]) -> None:
        """Queue the most urgent waiting allreduces that ``choose`` (Scheduler.batches_to_queue)
        takes, in ``room`` units agreed by every member, so every rank queues the same ones in the
        same order."""
        waiting = self._waiting
        waiting.sort(key=lambda item: (item[0].priority, item[0].name))
        batches = choose(waiting, room)
        del waiting[:sum(len(batch.responses) for batch in batches)]
        self._queued.extend(batches)
        self.queued_bytes += sum(batch.nbytes for batch in batches)

    def head(self) -> Optional[QueuedBatch]:
        """The next batch to start, if any."""
        return self._queued[0] if self._queued else None

    def pop(self) -> QueuedBatch:
        """Take the next batch to start it."""
        batch = self._queued.popleft()
        self.queued_bytes -= batch.nbytes
        return batch

    def clear(self) -> List[Request]:
        """Forget everything waiting and queued; return this rank's requests among them."""
        requests = [request for _, request in self._waiting if request is not None]
        requests += [request for batch in self._queued for request in batch.requests.values()]
        self._waiting = []
        self._queued.clear()
        self.queued_bytes = 0
        return requests


class ProcessSetState:
    """One process set as the engine sees it on this rank (``hpdl.torch``'s ``ProcessSet`` is the
    user's handle on it)."""

    def __init__(self, set_id: int, ranks: Sequence[int], controller: Optional[Controller],
                 data_comm: Optional[Communicator], paced: bool = False, flight_window: int = 1):
        """
        Args:
            controller: its negotiation; None when this rank is not a member.
            data_comm: where the collectives themselves run: the controller's group, or a
                node-aware wrapper of it (hierarchical allreduce).
            paced, flight_window: whether queued allreduces may start between rounds, and how
                many of their bytes may be in flight at once (Scheduler.pacing).
        """
        self.id = set_id
        self.ranks = list(ranks)
        self.controller = controller
        self.data_comm = data_comm
        self.paced = paced
        self.flight_window = flight_window
        self.pending: "collections.OrderedDict[str, Request]" = collections.OrderedDict()  # in arrival order
        self.backlog = Backlog()
        # Groups (as this rank's requests name them) a member of which failed in negotiation:
        # how many of this rank's members have yet to be submitted, and the response that failed.
        self._failed_groups: Dict[Tuple[str, int], Tuple[int, Response]] = {}

    def admit(self, request: Request) -> None:
        """Make ``request`` pending; or fail it at once when a member of its group failed in
        negotiation (:meth:`fail_groups`)."""
        failed = self._failed_groups
        if failed and request.group in failed:
            left, response = failed[request.group]
            if left > 1:
                failed[request.group] = (left - 1, response)
            else:
                del failed[request.group]
            request.handle.set_error(response.refused())
            return
        self.pending[request.name] = request

    def take(self, responses: List[Response]) -> List[Optional[Request]]:
        """Remove the pending requests of ``responses``; return them (None: this rank joined)."""
        pop = self.pending.pop
        return [pop(response.name, None) for response in responses]

    def fail_groups(self, failed: Dict[Tuple[str, int], Response], handled: List[Optional[Request]]) -> None:
        """A member of each group in ``failed`` failed in negotiation (group: its response): fail
        the rest of this rank's members too, pending now or admitted later. When the ranks
        disagree on a group's size, no other rank submits this rank's extra members; left
        pending, they would end the job at the stall timeout. Called before any handle of the
        round completes, so a caller that retries at once finds none of the old members in
        flight."""
        for group, response in failed.items():
            left = group[1] - sum(1 for request in handled if request is not None and request.group == group)
            for name in [name for name, request in self.pending.items() if request.group == group]:
                self.pending.pop(name).handle.set_error(response.refused())
                left -= 1
            if left > 0:
                self._failed_groups[group] = (left, response)

    def fail(self, message: str) -> None:
        """Fail every request of this set on this rank, pending, waiting or queued: their
        handles raise ``message``."""
        pending, self.pending = self.pending, collections.OrderedDict()
        for request in list(pending.values()) + self.backlog.clear():
            request.handle.set_error(HorovodInternalError(message))
