"""One process set as the engine sees it on this rank: its negotiation, the requests pending
in it, and the prioritized allreduces agreed but not started yet (see scheduling.py,
Priorities, for which of them are queued and when they start)."""

from __future__ import annotations

import collections
from typing import Dict, List, Optional, Sequence, Tuple

from hpdl.comm import Communicator
from hpdl.engine.negotiation import Controller
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
        # Whether queued allreduces may start between rounds, and how many of their bytes may
        # be in flight at once (Scheduler.pace).
        self.paced = False
        self.flight_window = 1
        # Groups (as this rank's requests name them) a member of which failed in negotiation:
        # how many of this rank's members have yet to be submitted, and the error they get then.
        self.failed_groups: Dict[Tuple[str, int], Tuple[int, str]] = {}
