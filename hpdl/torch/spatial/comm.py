"""A spatial group's own communicator: the halo exchanges and the group's few collectives.

Every spatial group gets a communicator of its own, apart from the engine's: the engine's
collectives run on its background thread while the training thread (or autograd's, in
backward) exchanges halos, and two threads must never issue collectives on one communicator
(MPI would interleave them, gloo might pair them differently on each rank). It is split from
the world on the engine thread, the only thread that may use the world communicator, in the
same order on every rank. Each exchange and collective is timed and reported to the engine's
event bus (kind ``halo`` or ``spatial``), so that ``hpdl profile`` and the timeline show it.

A measuring tool: with ``communicating`` off, nothing is sent or received (received strips are
zeros, a sum is this rank's alone, a gather holds this rank's values in its place and zeros
elsewhere), so that each rank computes its band alone, as fast as it can: the bound that
``hpdl bench spatial`` measures the real steps against (``SpatialParallel.no_communication``).
"""

from __future__ import annotations

import itertools
import time
from typing import List, Optional, Sequence, Tuple

import torch

from hpdl.comm.base import Communicator, ReduceOp
from hpdl.engine import events as ev
from hpdl.engine.request import Request, RequestKind
from hpdl.torch import runtime
from hpdl.torch.functions import allgather_object
from hpdl.torch.process_sets import ProcessSet
from hpdl.torch.spatial.geometry import SpatialError

HALO = ev.HALO  # event kind of a halo exchange
SPATIAL = ev.SPATIAL  # event kind of a spatial group's collective (BatchNorm statistics, global pooling, gather)

_splits = itertools.count()  # names of the split requests: every rank makes the same calls


class GroupComm:
    """The communicator of one spatial group, for the thread that runs the model."""

    def __init__(self, comm: Communicator, process_set_id: int):
        self.comm = comm
        self.process_set_id = process_set_id
        self.rank = comm.rank
        self.size = comm.size
        self._world_rank = runtime.rank()
        self._bus = runtime.engine().bus
        self.communicating = True  # off: a measuring tool, see the module's docstring

    def exchange(self, sends: Sequence[Tuple[int, torch.Tensor]], receives: Sequence[Tuple[int, torch.Tensor]],
                 label: str) -> None:
        """Send and receive halo rows with the neighbours (group ranks), reported as one ``halo`` event."""
        if not sends and not receives:
            return
        if not self.communicating:
            for _, strip in receives:
                strip.zero_()
            return
        start = time.perf_counter()
        self.comm.exchange(sends, receives)
        self._report(HALO, label, start, "SENDRECV", [t for _, t in sends] + [t for _, t in receives])

    def allreduce_sum(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place (contiguous); returns it."""
        if not self.communicating:
            return tensor
        start = time.perf_counter()
        self.comm.allreduce(tensor, ReduceOp.SUM)
        self._report(SPATIAL, label, start, "ALLREDUCE", [tensor])
        return tensor

    def allgather(self, tensor: torch.Tensor, first_dims: Optional[Sequence[int]], label: str) -> torch.Tensor:
        """Every member's ``tensor`` concatenated along dim 0, in group rank order."""
        if not self.communicating:
            return self._alone(tensor, first_dims)
        start = time.perf_counter()
        out = self.comm.allgather(tensor.contiguous(), first_dims)
        self._report(SPATIAL, label, start, "ALLGATHER", [tensor])
        return out

    def _alone(self, tensor: torch.Tensor, first_dims: Optional[Sequence[int]]) -> torch.Tensor:
        """What a gather holds without communication: this rank's rows in their place, zeros elsewhere."""
        dims = list(first_dims) if first_dims is not None else [tensor.shape[0]] * self.size
        out = tensor.new_zeros((sum(dims),) + tuple(tensor.shape[1:]))
        out.narrow(0, sum(dims[:self.rank]), dims[self.rank]).copy_(tensor)
        return out

    def _report(self, kind: str, label: str, start: float, op: str, tensors: List[torch.Tensor]) -> None:
        if not self._bus.active:
            return
        elapsed_us = (time.perf_counter() - start) * 1e6
        sizes = tuple(t.numel() * t.element_size() for t in tensors)
        self._bus.emit(ev.Event(ev.COLLECTIVE, kind, (label,), ev.now_us() - elapsed_us, elapsed_us,
                                nbytes=sum(sizes), op=op, rank=self._world_rank,
                                process_set_id=self.process_set_id, sizes=sizes,
                                dtype=str(tensors[0].dtype).replace("torch.", "") if tensors else "",
                                backend=self.comm.name))

    def close(self) -> None:
        self.comm.close()


def group_communicator(process_set: ProcessSet) -> GroupComm:
    """Make the communicator of this rank's spatial group ``process_set``.

    Collective over every rank of the job: each passes its own group. The groups must not
    overlap. Every group is split, in the same order on every rank, each rank keeping its own.
    """
    ranks = process_set.ranks
    if not ranks or process_set.rank() is None:
        raise SpatialError(f"rank {runtime.rank()} is not a member of its spatial process set {process_set}")
    groups = sorted(set(tuple(g) for g in allgather_object(tuple(ranks), name="spatial.groups")))
    seen = {}
    for group in groups:
        for r in group:
            if r in seen:
                raise SpatialError(f"rank {r} is in two spatial groups, {list(seen[r])} and {list(group)}: "
                                   "every rank belongs to one group")
            seen[r] = group
    engine = runtime.engine()
    call = next(_splits)
    mine = None
    for index, group in enumerate(groups):
        request = Request(RequestKind.SPLIT_COMMUNICATOR, f"spatial.split.{call}.{index}", splits=group)
        comm = engine.submit(request).wait()
        if comm is not None:
            mine = comm
    set_id = process_set.process_set_id if process_set.process_set_id is not None else 0
    return GroupComm(mine, set_id)
