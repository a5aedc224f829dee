"""The small interface every communication backend implements, on torch tensors.

A :class:`Communicator` is one group of ranks. All methods are collective over the group and
blocking, except :meth:`Communicator.allreduce_start`, which a backend that runs collectives on
threads of its own (torch.distributed) returns from at once; the engine calls them from its
single background thread, so implementations need not be thread-safe. Tensors passed in are
contiguous; in-place methods write into them. A communicator given a ``wait_hook`` waits
interruptibly instead, calling it between polls (a spatial group's).
"""

from __future__ import annotations

import abc
import enum
import os
from typing import Any, Callable, List, NoReturn, Optional, Sequence, Tuple

import torch

from hpdl.comm import objects


class ReduceOp(enum.Enum):
    """Element-wise reductions a backend performs (Average is Sum plus a scale, above)."""

    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    BAND = "band"  # bitwise, integer tensors only (the engine's bit-vector agreement)
    BOR = "bor"


class CommError(RuntimeError):
    """A backend failed to carry out a collective (a peer died, a timeout, a bad argument)."""


def even_split(length: int, parts: int) -> List[int]:
    """Split ``length`` rows into ``parts`` counts as evenly as possible, earlier parts larger."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class InFlight:
    """A collective started by :meth:`Communicator.allreduce_start`: done when its output is
    written. This base is the finished one that blocking backends return."""

    #: How often the engine must call :meth:`done` while it is in flight, in seconds, for a
    #: collective that nothing else moves on (MPI's progress happens only inside its calls);
    #: 0: it completes by itself.
    poll_interval_s = 0.0
    #: Whether the backend runs its collectives one after another (gloo's worker, nccl's
    #: stream): then one's own time starts when the one before it finished. MPI's
    #: non-blocking collectives progress side by side.
    runs_in_order = True

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        """Block until done; raise the backend's error if the collective failed."""

    def on_done(self, callback) -> None:
        """Call ``callback()`` once done (at once if it is), from whichever thread finished it."""
        callback()


FINISHED = InFlight()


class Communicator(abc.ABC):
    """A group of ranks that run collectives together."""

    #: "mpi", "gloo" or "nccl"
    name: str = "?"
    #: Called between polls while a control message waits for the peers, by a backend that
    #: moves the collectives in flight only inside its calls (MPI over TCP): the engine finishes
    #: what is done and starts what it has agreed meanwhile, so a round held up by a late peer
    #: (or by a control message queued behind megabytes of data on the same connection) does
    #: not leave the network idle.
    control_wait_hook: Optional[Callable[[], None]] = None
    #: Called between the polls of every wait of :meth:`exchange`, :meth:`allreduce` and
    #: :meth:`allgather`, by a communicator whose owner must be able to interrupt and bound them
    #: (a spatial group's, which checks whether the engine still runs and how long it has
    #: waited: hpdl/torch/spatial/comm.py). It may raise: the transfer is then abandoned, its
    #: buffers kept alive and its receives cancelled where the backend can, and the
    #: communicator must not be used again (the job is ending). None, as on the engine's own
    #: communicators: the waits block as they always did, at no cost.
    wait_hook: Optional[Callable[[], None]] = None
    #: Whether the collectives started with :meth:`allreduce_start` run one after another in
    #: the order they started (gloo's and nccl's work queues) rather than side by side (MPI's
    #: non-blocking collectives, which share the network as they progress).
    runs_in_order: bool = True
    #: Whether :meth:`allreduce_start` returns before the collective is done (a backend with
    #: threads of its own, or polled), so that the engine may start collectives between its
    #: rounds; when it blocks, the engine starts them only in its rounds' agreed order.
    background_collectives: bool = False

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank within the group."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Number of ranks in the group."""

    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        """Reduce ``tensor`` across ranks, in place."""

    def allreduce_start(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> InFlight:
        """Start reducing ``tensor`` in place and return at once if the backend can run it in
        the background, else reduce it before returning (this default). Every rank starts its
        collectives in the same order; ``tensor`` must not be touched until it is done."""
        self.allreduce(tensor, op)
        return FINISHED

    def allreduce_control(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """Reduce a small control message in place, waiting without spinning where possible."""
        self.allreduce(tensor, op)

    def allgather_object_control(self, obj: Any) -> List[Any]:
        """:meth:`allgather_object` for the engine's negotiation, beside its control messages."""
        return self.allgather_object(obj)

    @abc.abstractmethod
    def allgather(self, tensor: torch.Tensor, first_dims: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along dim 0; first dims may differ.

        Args:
            tensor: this rank's contribution.
            first_dims: every rank's first dimension when already known (saves an exchange).
        """

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Overwrite ``tensor`` on every rank with root's, in place."""

    @abc.abstractmethod
    def alltoall(
        self, tensor: torch.Tensor, splits: Sequence[int], recv_splits: Optional[Sequence[int]] = None
    ) -> Tuple[torch.Tensor, List[int]]:
        """Send ``splits[r]`` rows of ``tensor`` (in order) to rank r; return what arrived.

        Returns:
            the received rows concatenated in rank order, and how many came from each rank.
        """

    @abc.abstractmethod
    def reduce_scatter(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, counts: Optional[Sequence[int]] = None
    ) -> torch.Tensor:
        """Reduce ``tensor`` across ranks and return this rank's block of rows.

        Args:
            counts: rows per rank (default: dim 0 split as evenly as possible, earlier ranks
                taking the remainder, as Horovod does).
        """

    def exchange(self, sends: Sequence[Tuple[int, torch.Tensor]],
                 receives: Sequence[Tuple[int, torch.Tensor]]) -> None:
        """Point to point: send each ``(peer, tensor)`` of ``sends`` and receive into each
        ``(peer, tensor)`` of ``receives``, all started at once; return when all are done.

        Not collective: each send meets the receive its peer posts for it, matched in order
        among the messages between the same two ranks. For a communicator of the caller's own
        (never the engine's), used from one thread at a time.
        """
        raise CommError(f"the {self.name} backend has no point-to-point transfers")

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank of the group has arrived."""

    @abc.abstractmethod
    def split(self, ranks: Sequence[int]) -> Optional["Communicator"]:
        """Create a sub-group of ``ranks`` (group ranks); collective over the whole group.

        Returns:
            the sub-group on its members, None on the others.
        """

    def host_names(self) -> List[str]:
        """Return every rank's node (``topology.host_identity``: host name and network namespace), in rank order."""
        from hpdl.comm.topology import host_identity

        return self.allgather_object(host_identity())

    def node_layout(self) -> Tuple[int, int, int, int]:
        """Return (local_rank, local_size, cross_rank, cross_size) as Horovod defines them."""
        from hpdl.comm.topology import topology_from_ranks

        topo = topology_from_ranks(self.rank, self.host_names(), self.name)
        return topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size

    def allgather_bytes(self, payload: bytes) -> List[bytes]:
        """Gather a byte string from every rank (sizes may differ)."""
        lengths = torch.tensor([len(payload)], dtype=torch.int64)
        all_lengths = self.allgather(lengths, first_dims=[1] * self.size).tolist()
        gathered = self.allgather(objects.bytes_to_tensor(payload), first_dims=all_lengths)
        return objects.payloads_in(gathered, all_lengths)

    def allgather_object(self, obj: Any) -> List[Any]:
        """Gather a picklable object from every rank, in rank order."""
        return [objects.loads(payload) for payload in self.allgather_bytes(objects.dumps(obj))]

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Return root's ``obj`` on every rank."""
        data = objects.to_tensor(obj) if self.rank == root else None
        length = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
        self.broadcast(length, root)
        if data is None:
            data = torch.zeros(int(length.item()), dtype=torch.uint8)
        self.broadcast(data, root)
        return objects.from_tensor(data)

    def unanswering(self, wait_s: float) -> Optional[List[int]]:
        """After a failure: the ranks that do not answer a liveness check within ``wait_s``.

        Every surviving rank runs it at about the same time (they all see the failure of the
        same collective). Returns None where the backend cannot tell.
        """
        return None

    def close(self) -> None:
        """Release the group's resources (the world group may outlive this call)."""

    def abort(self, code: int) -> NoReturn:
        """End the whole job at once, from any thread, even while a peer is stuck: never returns.

        The default ends this process; a backend whose launcher needs telling (MPI) overrides it.
        """
        os._exit(code)

    def describe(self) -> str:
        """One line naming the backend and its library, for logs and ``hpdl check``."""
        return self.name
