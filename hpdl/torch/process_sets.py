"""Process sets: collectives among a subset of ranks, as in Horovod.

A :class:`ProcessSet` names its ranks; it gets an id when registered (``init(process_sets=)``
or :func:`add_process_set`, which every rank must call in the same order). The set of all
ranks is :data:`global_process_set` (id 0).

This module asks the runtime for the job's rank and size and for its engine; hpdl.torch
hands the runtime over with :func:`use_runtime` (as Horovod's ``_setup(basics)``), so the two
modules do not import each other.
"""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any, List, Optional, Sequence, Union

from hpdl.engine import Request, RequestKind

_runtime: Optional[ModuleType] = None  # hpdl.torch.runtime, once hpdl.torch has called use_runtime


def use_runtime(runtime: ModuleType) -> None:
    """Give this module the runtime it asks for rank, size and the engine."""
    global _runtime
    _runtime = runtime


class ProcessSet:
    """A subset of ranks that run collectives among themselves."""

    def __init__(self, ranks_or_comm: Union[Sequence[int], Any]):
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator: its world ranks
            self.mpi_comm = ranks_or_comm
            from mpi4py import MPI

            group = ranks_or_comm.Get_group()
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), MPI.COMM_WORLD.Get_group())
        else:
            ranks = ranks_or_comm
        self.ranks: Optional[List[int]] = sorted(int(r) for r in ranks) if ranks is not None else None
        self.process_set_id: Optional[int] = None

    def _invalidate(self) -> None:
        self.process_set_id = None

    def _registered(self) -> int:
        if self.process_set_id is None:
            raise ValueError(f"process set with ranks {self.ranks} is not registered; call hvd.add_process_set() first")
        return self.process_set_id

    def size(self) -> Optional[int]:
        """Number of ranks in the set."""
        return len(self.ranks) if self.ranks is not None else None

    def rank(self) -> Optional[int]:
        """This process's rank within the set, or None when it is not a member."""
        r = _runtime.rank()
        return self.ranks.index(r) if self.ranks is not None and r in self.ranks else None

    def included(self) -> bool:
        """Return whether this process is a member of the set."""
        return self.rank() is not None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks and self.process_set_id == other.process_set_id

    def __hash__(self) -> int:
        return hash((tuple(self.ranks or ()), self.process_set_id))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """All ranks; its ranks follow the current init()."""

    def __init__(self) -> None:
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self) -> List[int]:  # type: ignore[override]
        return list(range(_runtime.size())) if _runtime.is_initialized() else []

    @ranks.setter
    def ranks(self, value) -> None:
        pass

    def _invalidate(self) -> None:
        pass


global_process_set: ProcessSet = _GlobalProcessSet()
_registered: List[ProcessSet] = []
# Calls of add_process_set / remove_process_set since init(), which name their requests: every
# rank must make the same calls in the same order, so a rank that names other ranks (or
# another set) than its peers is told so at once, instead of each waiting for a request of
# its own name that no other rank submits.
_changes = itertools.count()


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set on every rank (collective: all ranks call it in the same order)."""
    engine = _runtime.engine()
    size = _runtime.size
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    if not ps.ranks or any(r < 0 or r >= size() for r in ps.ranks) or len(set(ps.ranks)) != len(ps.ranks):
        raise ValueError(f"process set ranks must be distinct ranks in 0..{size() - 1}, got {ps.ranks}")
    for other in _registered:
        if other.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} is already registered ({other})")
    request = Request(RequestKind.ADD_PROCESS_SET, f"process_set.add.{next(_changes)}", ranks=tuple(ps.ranks))
    ps.process_set_id = engine.submit(request).wait()
    _registered.append(ps)
    return ps


def registered_with(ranks: Sequence[int]) -> Optional[ProcessSet]:
    """The registered process set of exactly ``ranks``, if there is one."""
    wanted = sorted(int(r) for r in ranks)
    return next((ps for ps in _registered if ps.ranks == wanted), None)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (collective); return whether it was registered."""
    if process_set.process_set_id in (None, 0) or process_set not in _registered:
        return False
    engine = _runtime.engine()
    set_id = process_set.process_set_id
    engine.submit(Request(RequestKind.REMOVE_PROCESS_SET, f"process_set.remove.{next(_changes)}",
                          removed_set=set_id)).wait()
    _registered.remove(process_set)
    process_set._invalidate()
    return True


def forget_registered() -> None:
    """Forget every registered set (the runtime's shutdown)."""
    global _changes
    _changes = itertools.count()
    for ps in _registered:
        ps._invalidate()
    _registered.clear()


def process_set_id(process_set: ProcessSet) -> int:
    """The id the engine knows ``process_set`` by (refused where it is not registered)."""
    set_id = process_set.process_set_id
    return set_id if set_id is not None else process_set._registered()
