"""What the engine is asked to do (requests) and what the ranks agreed to do (responses)."""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Tuple

import torch

from hpdl.comm.dtypes import DTYPES, dtype_name
from hpdl.engine.errors import NegotiationError


class RequestKind(enum.Enum):
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    BARRIER = "barrier"
    JOIN = "join"  # ``join_device``: where this rank's zeros go on a GPU
    ADD_PROCESS_SET = "add_process_set"  # ``ranks``: the new set's members
    REMOVE_PROCESS_SET = "remove_process_set"  # ``removed_set``: the set's id
    # A communicator of ``ranks`` for the caller's own use, apart from the engine's (spatial
    # parallelism's halo exchanges): made on the engine thread, which alone may use the world
    # communicator, in the same agreed order on every rank.
    SPLIT_COMMUNICATOR = "split_communicator"

    @property
    def controls_engine(self) -> bool:
        """Whether the engine itself runs this kind (join, process sets, communicators), not a
        backend collective: such requests change what the engine is, so they never enter the
        response cache."""
        return self in _CONTROLS_ENGINE


_CONTROLS_ENGINE = frozenset((RequestKind.JOIN, RequestKind.ADD_PROCESS_SET, RequestKind.REMOVE_PROCESS_SET,
                              RequestKind.SPLIT_COMMUNICATOR))


class Op(enum.Enum):
    """Reductions as the API names them (Average is a sum followed by a scale)."""

    AVERAGE = "average"
    SUM = "sum"
    ADASUM = "adasum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


class Signature(NamedTuple):
    """What must agree across ranks about one request: compared field by field in negotiation
    (a mismatch names the field), part of the response-cache key, and sent in full exchanges.

    Fields that do not apply to the request's kind are None (``op`` and ``scales`` outside
    allreduce and reducescatter, ``root`` outside broadcast, ``ranks`` outside adding a process
    set and splitting a communicator, ``removed_set`` outside removing a process set,
    everything about the tensor for requests without one). For allgather and alltoall only the
    trailing dimensions of ``shape`` must agree; the first dimension and alltoall's ``splits``,
    which may differ between ranks, still belong to the signature so that a change
    invalidates the cache.
    """

    kind: str  # RequestKind's value
    dtype: Optional[str]  # dtype_name of the tensor
    shape: Optional[Tuple[int, ...]]
    device: Optional[str]  # the device type: "cpu", "cuda"
    op: Optional[str]  # Op's value
    root: Optional[int]
    scales: Optional[Tuple[float, float]]  # (prescale, postscale)
    splits: Optional[Tuple[int, ...]]
    group: Optional[Tuple[str, int]]  # (group name, member count)
    priority: Optional[int]
    ranks: Optional[Tuple[int, ...]]  # the member ranks of a process set or communicator made
    removed_set: Optional[int]  # the id of the process set removed


_tuple_new = tuple.__new__


def signature_of(fields: Tuple) -> Signature:
    """The Signature whose fields, in Signature's order, are ``fields``.

    It skips ``Signature.__new__``'s argument handling, which costs more than the tuple itself,
    where that matters: once per tensor per step, and for every entry of a full exchange
    received (which travels as plain tuples).
    """
    return _tuple_new(Signature, fields)


class Request:
    """One named collective submitted by this rank.

    ``tensor`` is this rank's input (contiguous); ``output`` receives the result in place for
    allreduce and broadcast (it may be ``tensor`` itself); other kinds allocate their output.
    ``group`` = (group name, member count) asks that all members be negotiated and fused
    together. ``priority`` (an allreduce's; lower runs sooner) holds it back once agreed, to
    start in priority order as the backend has room (see scheduling.py, Priorities).
    ``bytes_to_come`` (an allreduce's, optional) is how many bytes the caller will submit right
    after it in the same burst (DistributedOptimizer: the step's gradients not yet made); it
    ends a gathering early, so that the last gradients are not held back together (see
    scheduling.py, Gathering). It is a local hint, not part of the signature. ``root`` is a
    broadcast's, ``splits`` an alltoall's; ``ranks`` are the members of a process set added or
    a communicator split, ``removed_set`` the id of a process set removed, and ``join_device``
    the GPU of the zeros a joined rank contributes (local, as each rank has its own). A plain
    class with slots: one is made per tensor per training step.
    """

    __slots__ = ("kind", "name", "tensor", "output", "op", "prescale", "postscale", "root", "splits",
                 "process_set_id", "group", "priority", "bytes_to_come", "ranks", "removed_set", "join_device",
                 "handle", "arrival", "_signature")

    def __init__(self, kind: RequestKind, name: str, tensor: Optional[torch.Tensor] = None,
                 output: Optional[torch.Tensor] = None, op: Op = Op.SUM, prescale: float = 1.0,
                 postscale: float = 1.0, root: int = 0, splits: Optional[Tuple[int, ...]] = None,
                 process_set_id: int = 0, group: Optional[Tuple[str, int]] = None,
                 priority: Optional[int] = None, bytes_to_come: Optional[int] = None,
                 ranks: Optional[Tuple[int, ...]] = None, removed_set: Optional[int] = None,
                 join_device: int = -1):
        self.kind = kind
        self.name = name
        self.tensor = tensor
        self.output = output
        self.op = op
        self.prescale = prescale
        self.postscale = postscale
        self.root = root
        self.splits = splits
        self.process_set_id = process_set_id
        self.group = group
        self.priority = priority
        self.bytes_to_come = bytes_to_come
        self.ranks = ranks
        self.removed_set = removed_set
        self.join_device = join_device
        self.handle = None  # set by the engine at submission
        self.arrival = 0.0  # when the engine thread took it from the queue (the engine clock's time)
        self._signature: Optional[Signature] = None

    def signature(self) -> Signature:
        """What must agree across ranks (made once, on first use)."""
        sig = self._signature
        if sig is None:
            sig = self._signature = self._make_signature()
        return sig

    def _make_signature(self) -> Signature:
        # Enum's .value is a descriptor call; ._value_ is the plain attribute behind it, and
        # this runs once per tensor per step.
        t = self.tensor
        kind = self.kind
        if t is None:
            return Signature(kind=kind._value_, dtype=None, shape=None, device=None, op=None, root=None,
                             scales=None, splits=None, group=self.group, priority=None, ranks=self.ranks,
                             removed_set=self.removed_set)
        reduces = kind is RequestKind.ALLREDUCE or kind is RequestKind.REDUCESCATTER
        return _tuple_new(Signature, (  # signature_of, inlined: in Signature's order
            kind._value_,  # kind
            dtype_name(t.dtype),  # dtype
            tuple(t.shape),  # shape
            "cpu" if t.is_cpu else t.device.type,  # device
            self.op._value_ if reduces else None,  # op
            self.root if kind is RequestKind.BROADCAST else None,  # root
            (self.prescale, self.postscale) if reduces else None,  # scales
            self.splits,
            self.group,
            self.priority,
            None,  # ranks
            None,  # removed_set
        ))

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()


class Response:
    """A collective every member agreed to run now, in the same order on every rank.

    ``signatures[r]`` is member r's request signature (the per-rank first dimensions of an
    allgather and the splits of an alltoall come from there). ``error`` makes every rank fail
    the request with that message instead of running it. ``joined`` lists members that have
    called join() and contribute zeros. What fusion asks of a response on every step (its
    representative signature, element count, bytes, fusion key) is computed once here, since
    cached responses are reused step after step.
    """

    __slots__ = ("name", "kind", "signatures", "error", "joined", "last_joined", "signature", "numel",
                 "nbytes", "group", "priority", "fusion_key")

    def __init__(self, name: str, kind: RequestKind, signatures: Tuple[Optional[Signature], ...],
                 error: Optional[str] = None, joined: Tuple[int, ...] = (), last_joined: int = -1):
        self.name = name
        self.kind = kind
        self.signatures = signatures
        self.error = error
        self.joined = joined
        self.last_joined = last_joined
        # The signature of the first member that submitted a request (joined ones did not).
        sig = next((s for s in signatures if s is not None), None)
        if sig is None:
            sig = Signature(kind=kind.value, dtype=None, shape=None, device=None, op=None, root=None, scales=None,
                            splits=None, group=None, priority=None, ranks=None, removed_set=None)
        self.signature: Signature = sig
        numel = 0
        if sig.shape is not None:
            numel = 1
            for d in sig.shape:
                numel *= d
        self.numel = numel
        self.nbytes = numel * _ITEMSIZE.get(sig.dtype, 0)
        self.group = sig.group
        self.priority = sig.priority
        # Responses with equal keys may share one fused allreduce.
        self.fusion_key = (sig.dtype, sig.device, sig.op, sig.scales, joined)

    def refused(self) -> NegotiationError:
        """What this rank's request raises when the members agreed not to run it (``error``)."""
        kinds = frozenset(sig.kind for sig in self.signatures if sig is not None)
        return NegotiationError(self.error, kinds, self.joined)

    def __repr__(self) -> str:
        return f"Response({self.name!r}, {self.kind.value}, error={self.error!r})"


_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}
