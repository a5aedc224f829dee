"""The rendezvous of an elastic job: which workers form each generation of the world.

An elastic job's driver (`hpdl run --min-np ...`, hpdl/launch/elastic/) hosts one
``torch.distributed.TCPStore``; every worker connects to it as a client. Nothing here is a
server or a wire format of hpdl's own: the store is torch's, and each generation's process
group meets through its own prefix of that store (``PrefixStore``), exactly as
``init_process_group(store=...)`` is meant to be used. This module names the keys and reads and
writes them, for the driver and the workers alike, so that the protocol lives in one place.

Keys, all under ``hpdl/elastic/``:

==========================  =================================================================
``generation``              the newest generation's number (set after its members)
``gen/<g>/members``         JSON: the generation's :class:`Slot` of every member, in rank order
``gen/<g>/arrived``         a counter: members that came to form generation g
``gen/<g>/ended``           why generation g ended before its members left it: set by the
                            driver (a worker died) or by a worker (a collective failed)
``gen/<g>/pg/...``          the keys of generation g's process group (gloo's own rendezvous)
``hosts_updated``           ``"<n> <added|removed>"``: the n-th change of hosts the driver has
                            acted on, and whether any host was added (commit() reads it)
``left/<worker>``           the generation in which the worker's training function returned
==========================  =================================================================

A worker keeps its ``worker`` id (``HPDL_ELASTIC_WORKER``) for the job's whole life; ids grow
with start time, so the driver gives the lowest ranks, rank 0 included, to the oldest workers.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

PREFIX = "hpdl/elastic/"
# What a worker finds in its environment (the driver sets them).
STORE_VARIABLE = "HPDL_ELASTIC_STORE"  # host:port of the driver's TCPStore
WORKER_VARIABLE = "HPDL_ELASTIC_WORKER"  # this worker's id
POLL_S = 0.02  # how often a waiting worker or the driver looks at a key that has not come yet


class RendezvousError(RuntimeError):
    """The rendezvous cannot give this worker a place (the driver is gone, or timed out)."""


class NotInWorld(RendezvousError):
    """The newest generation leaves this worker out (its host was removed): it should exit."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """One worker's place in a generation, as Horovod's launcher environment describes it."""

    worker: int
    hostname: str  # as the host list or the discovery script gives it
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def horovod_environment(self) -> Dict[str, str]:
        """The variables horovodrun gives a worker (HOROVOD_RANK, ...)."""
        return {"HOROVOD_HOSTNAME": self.hostname, "HOROVOD_RANK": str(self.rank), "HOROVOD_SIZE": str(self.size),
                "HOROVOD_LOCAL_RANK": str(self.local_rank), "HOROVOD_LOCAL_SIZE": str(self.local_size),
                "HOROVOD_CROSS_RANK": str(self.cross_rank), "HOROVOD_CROSS_SIZE": str(self.cross_size)}


def assign_slots(workers: List[Tuple[int, str]]) -> List[Slot]:
    """Ranks for ``workers`` (``(id, host)``, oldest first): host by host, the host of the
    oldest worker first, and within a host oldest first, as Horovod assigns them, so that
    rank 0 is the oldest worker. Local ranks count within a host; the cross rank of a worker
    is the index of its host among the hosts that have its local rank."""
    hosts: Dict[str, List[int]] = {}
    for worker, host in sorted(workers):
        hosts.setdefault(host, []).append(worker)
    slots: List[Slot] = []
    size = len(workers)
    for host, members in hosts.items():
        for local_rank, worker in enumerate(members):
            peers = [h for h, m in hosts.items() if len(m) > local_rank]
            slots.append(Slot(worker, host, len(slots), size, local_rank, len(members), peers.index(host), len(peers)))
    return slots


def _key(name: str) -> str:
    return PREFIX + name


class Rendezvous:
    """The store's keys, read and written (the driver's side and the workers' alike)."""

    def __init__(self, store):
        self.store = store

    @classmethod
    def connect(cls, address: str, timeout_s: float) -> "Rendezvous":
        """A worker's client of the driver's store at ``address`` (``host:port``)."""
        from torch.distributed import TCPStore

        host, _, port = address.rpartition(":")
        try:
            store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as err:
            raise RendezvousError(f"cannot reach the elastic driver's store at {address}: {err}") from None
        return cls(store)

    # -- generations -----------------------------------------------------------------------

    def publish(self, generation: int, slots: List[Slot]) -> None:
        """The driver's: generation ``generation`` is ``slots`` (its members first, then its number)."""
        self.store.set(_key(f"gen/{generation}/members"), json.dumps([dataclasses.asdict(s) for s in slots]))
        self.store.set(_key("generation"), str(generation))

    def newest(self) -> int:
        """The newest generation's number (-1 before the first)."""
        if not self.store.check([_key("generation")]):
            return -1
        return int(self.store.get(_key("generation")))

    def members(self, generation: int) -> List[Slot]:
        return [Slot(**fields) for fields in json.loads(self.store.get(_key(f"gen/{generation}/members")))]

    def end(self, generation: int, reason: str) -> None:
        """Generation ``generation`` can no longer complete a collective (the first reason stays)."""
        self.store.compare_set(_key(f"gen/{generation}/ended"), "", reason)

    def ended(self, generation: int) -> Optional[str]:
        """Why generation ``generation`` ended, or None while it runs."""
        key = _key(f"gen/{generation}/ended")
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode("utf-8", "replace")

    def arrive(self, generation: int) -> int:
        """Count this worker in among those come to form ``generation``; return how many have."""
        return self.store.add(_key(f"gen/{generation}/arrived"), 1)

    def arrived(self, generation: int) -> int:
        return self.store.add(_key(f"gen/{generation}/arrived"), 0)

    def process_group_store(self, generation: int):
        """The store generation ``generation``'s process group meets through."""
        from torch.distributed import PrefixStore

        return PrefixStore(_key(f"gen/{generation}/pg/"), self.store)

    # -- hosts and workers -------------------------------------------------------------------

    def hosts_updated(self, count: int, added: bool) -> None:
        """The driver's: the ``count``-th change of hosts it acted on."""
        self.store.set(_key("hosts_updated"), f"{count} {'added' if added else 'removed'}")

    def host_updates(self) -> Tuple[int, bool]:
        """How many changes of hosts the driver has acted on, and whether the last added one."""
        if not self.store.check([_key("hosts_updated")]):
            return 0, False
        count, kind = self.store.get(_key("hosts_updated")).decode().split()
        return int(count), kind == "added"

    def leave(self, worker: int, generation: int) -> None:
        """The worker's training function returned in ``generation``: it takes part in no reset
        from now on."""
        self.store.set(_key(f"left/{worker}"), str(generation))

    def left_in(self, worker: int) -> Optional[int]:
        """The generation in which the worker's training function returned, or None."""
        key = _key(f"left/{worker}")
        return int(self.store.get(key)) if self.store.check([key]) else None

    # -- a worker joining ----------------------------------------------------------------------

    def join(self, worker: int, after: int, timeout_s: float,
             still_waiting: Callable[[], None] = lambda: None) -> Tuple[int, Slot]:
        """Wait for the first generation newer than ``after`` that is complete and lists
        ``worker``; return it and this worker's slot once every member has come.

        A generation superseded or ended while its members gather is left for the next one.

        Raises:
            NotInWorld: the newest generation leaves this worker out.
            RendezvousError: no generation formed within ``timeout_s`` (the elastic timeout).
        """
        deadline = time.monotonic() + timeout_s
        counted = None
        while time.monotonic() < deadline:
            still_waiting()
            generation = self.newest()
            if generation <= after or self.ended(generation) is not None:
                time.sleep(POLL_S)
                continue
            slots = {s.worker: s for s in self.members(generation)}
            if worker not in slots:
                raise NotInWorld(f"generation {generation} of the job leaves worker {worker} out")
            if counted != generation:
                self.arrive(generation)
                counted = generation
            size = len(slots)
            while time.monotonic() < deadline and self.newest() == generation and self.ended(generation) is None:
                if self.arrived(generation) >= size:
                    return generation, slots[worker]
                time.sleep(POLL_S)
        raise RendezvousError(f"no world formed for worker {worker} within {timeout_s:g} s (the elastic timeout)")


def worker_from_environment(env: Optional[Dict[str, str]] = None) -> Optional[Tuple[str, int]]:
    """``(store address, worker id)`` when this process is a worker of an elastic job, else None."""
    env = os.environ if env is None else env
    if STORE_VARIABLE not in env or WORKER_VARIABLE not in env:
        return None
    return env[STORE_VARIABLE], int(env[WORKER_VARIABLE])
