"""One process set as the engine sees it on this rank: its negotiation, the requests pending
in it, and the prioritized allreduces agreed but not started yet (see engine.py, Priorities)."""

from __future__ import annotations

import collections
from typing import Dict, List, Optional, Sequence, Tuple

from hpdl.comm import Communicator
from hpdl.engine.negotiation import ROOM_UNITS, Controller
from hpdl.engine.request import Request, Response


class ProcessSet:
    """One process set as the engine sees it on this rank."""

    def __init__(self, set_id: int, ranks: Sequence[int], controller: Optional[Controller],
                 data_comm: Optional[Communicator] = None):
        self.id = set_id
        self.ranks = list(ranks)
        self.controller = controller  # None when this rank is not a member
        # Where the collectives themselves run: the controller's group, or a node-aware
        # wrapper of it (hierarchical allreduce).
        self.data_comm = data_comm if data_comm is not None else (controller.comm if controller else None)
        self.pending: "collections.OrderedDict[str, Request]" = collections.OrderedDict()
        # Agreed prioritized allreduces not started yet, with this rank's request (None: joined).
        self.backlog: List[Tuple[Response, Optional[Request]]] = []
        # Taken from the backlog in an agreed order, started as this rank's window has room:
        # batches of responses, this rank's requests by name, and their bytes.
        self.queued: "collections.deque[Tuple[List[Response], Dict[str, Request], int]]" = collections.deque()
        # Whether queued allreduces may start between rounds (see Engine._start_queued), and
        # how many of their bytes may be in flight at once.
        self.paced = False
        self.flight_window = 1
        # Groups (as this rank's requests name them) a member of which failed in negotiation:
        # how many of this rank's members have yet to be submitted, and the error they get then.
        self.failed_groups: Dict[Tuple[str, int], Tuple[int, str]] = {}

    def queue_from_backlog(self, room: int, window: int, alone: int) -> int:
        """Queue the most urgent of the backlog that fit in ``room`` units of ``window`` bytes
        (agreed by every member, so every rank queues the same, in the same order): tensors of
        ``alone`` bytes or more each alone, smaller ones together, to be fused. Return the
        bytes queued."""
        backlog = self.backlog
        backlog.sort(key=lambda item: (item[0].priority, item[0].name))
        budget = room * window // ROOM_UNITS
        taken, used = 0, 0
        for response, _ in backlog:
            # A window empty on every rank takes the next one whatever its size.
            if used + response.nbytes > budget and not (taken == 0 and room == ROOM_UNITS):
                break
            used += response.nbytes
            taken += 1
        started, self.backlog = backlog[:taken], backlog[taken:]
        batch: List[Response] = []
        requests: Dict[str, Request] = {}
        nbytes = 0
        for response, request in started:
            if response.nbytes >= alone and batch:
                self.queued.append((batch, requests, nbytes))
                batch, requests, nbytes = [], {}, 0
            batch.append(response)
            nbytes += response.nbytes
            if request is not None:
                requests[response.name] = request
            if nbytes >= alone:
                self.queued.append((batch, requests, nbytes))
                batch, requests, nbytes = [], {}, 0
        if batch:
            self.queued.append((batch, requests, nbytes))
        return used
