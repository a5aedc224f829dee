"""How many threads a rank of ``hpdl sr`` takes: its share of its node's cores.

One process per core is the usual layout on CPUs, so by default each rank takes its share of
the cores the ranks of its node may run on; more threads than cores only adds contention.
"""

from __future__ import annotations

import os
import socket
from typing import List, Optional

import hpdl.torch as hvd

__all__ = ["cpu_set", "share_of_cores", "thread_oversubscription"]


def share_of_cores() -> int:
    """This rank's share of its node's cores (at least 1), after ``hvd.init()``."""
    return max(1, len(cpu_set()) // hvd.local_size())


def cpu_set() -> List[int]:
    """The cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return list(range(os.cpu_count() or 1))


def thread_oversubscription(threads: int) -> Optional[str]:
    """On every rank (it gathers): on rank 0, why ``threads`` per rank are too many for its node, if they are.

    The ranks of a node share its cores, unless the launcher bound each to its own: the threads
    of all of them count against the cores they may run on together, and each rank's against
    its own.
    """
    placement = hvd.allgather_object((socket.gethostname(), cpu_set()), name="train.cores")
    if hvd.rank() != 0:
        return None
    node = [set(cpus) for host, cpus in placement if host == placement[0][0]]
    usable = set().union(*node)
    if len(node) == 1:
        return f"threads={threads} is more than the {len(usable)} cores this process can use" \
            if threads > len(usable) else None
    if threads * len(node) > len(usable):
        return (f"threads={threads} on each of the {len(node)} ranks of this node is {threads * len(node)} "
                f"threads, more than the {len(usable)} cores they can use")
    fewest = min(len(cpus) for cpus in node)
    if threads > fewest:
        return f"threads={threads} is more than the {fewest} cores a rank of this node is bound to"
    return None
