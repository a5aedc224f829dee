"""How many threads a rank of ``hpdl sr`` takes, by one rule for every command.

An explicit ``threads=`` wins, then ``OMP_NUM_THREADS`` (the variable every OpenMP program and
PyTorch itself honour), then the rank's share of the cores the ranks of its node may run on:
one process per core is the usual layout on CPUs, and more threads than cores only adds
contention. The commands say the number and where it came from (``ThreadCount``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import List, Mapping, Optional

import torch

import hpdl.torch as hvd

__all__ = ["ThreadCount", "cpu_set", "omp_num_threads", "thread_count", "thread_oversubscription", "use_threads"]


@dataclasses.dataclass(frozen=True)
class ThreadCount:
    """A rank's thread count and where it came from (``threads=2``, ``OMP_NUM_THREADS=1``, the cores)."""

    count: int
    source: str

    def __str__(self) -> str:
        return f"{self.count} thread(s) per rank ({self.source})"


def thread_count(threads: int = 0, ranks_on_node: Optional[int] = None,
                 env: Optional[Mapping[str, str]] = None) -> ThreadCount:
    """This rank's threads: ``threads`` if above 0, else ``OMP_NUM_THREADS``, else its share of the cores.

    Args:
        threads: An explicit count (the config's ``threads=``); 0 for none.
        ranks_on_node: The ranks sharing this node's cores (default: ``hvd.local_size()``, after
            ``hvd.init()``; 1 for a command that is one process's work).
        env: The environment to read (default: ``os.environ``).
    """
    if threads > 0:
        return ThreadCount(threads, f"threads={threads}")
    omp = omp_num_threads(os.environ if env is None else env)
    if omp is not None:
        return ThreadCount(omp, f"OMP_NUM_THREADS={omp}")
    ranks = hvd.local_size() if ranks_on_node is None else ranks_on_node
    cores = len(cpu_set())
    return ThreadCount(max(1, cores // ranks), f"{cores} core(s) for {ranks} rank(s) on this node")


def use_threads(threads: int = 0, ranks_on_node: Optional[int] = None) -> ThreadCount:
    """Set torch's threads by ``thread_count``'s rule; return the count and its source."""
    chosen = thread_count(threads, ranks_on_node)
    torch.set_num_threads(chosen.count)
    return chosen


def omp_num_threads(env: Mapping[str, str]) -> Optional[int]:
    """``OMP_NUM_THREADS``'s count (the first level of a nested list, ``4,2``), or None when unset
    or not a positive whole number (OpenMP ignores such a value too)."""
    first = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


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
