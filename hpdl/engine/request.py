"""What the engine is asked to do (requests) and what the ranks agreed to do (responses)."""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Tuple

import torch

from hpdl.comm.dtypes import DTYPES, dtype_name


class RequestKind(enum.Enum):
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    BARRIER = "barrier"
    JOIN = "join"
    ADD_PROCESS_SET = "add_process_set"  # ``splits`` carries the member ranks
    REMOVE_PROCESS_SET = "remove_process_set"  # ``root`` carries the set's id
    # A communicator of ``splits`` ranks for the caller's own use, apart from the engine's
    # (spatial parallelism's halo exchanges): made on the engine thread, which alone may use
    # the world communicator, in the same agreed order on every rank.
    SPLIT_COMMUNICATOR = "split_communicator"


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
    allreduce and reducescatter, ``root`` outside broadcast, everything about the tensor for
    requests without one). For allgather and alltoall only the trailing dimensions of
    ``shape`` must agree; the first dimension and ``splits`` still belong to the signature so
    that a change invalidates the cache. ``splits`` also carries the member ranks of process
    set and communicator requests, and ``root`` a removed set's id.
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
    scheduling.py, Gathering). It is a local hint, not part of the signature. A plain class with
    slots: one is made per tensor per training step.
    """

    __slots__ = ("kind", "name", "tensor", "output", "op", "prescale", "postscale", "root", "splits",
                 "process_set_id", "group", "priority", "bytes_to_come", "handle", "arrival", "_signature")

    def __init__(self, kind: RequestKind, name: str, tensor: Optional[torch.Tensor] = None,
                 output: Optional[torch.Tensor] = None, op: Op = Op.SUM, prescale: float = 1.0,
                 postscale: float = 1.0, root: int = 0, splits: Optional[Tuple[int, ...]] = None,
                 process_set_id: int = 0, group: Optional[Tuple[str, int]] = None,
                 priority: Optional[int] = None, bytes_to_come: Optional[int] = None):
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
            return Signature(kind=kind._value_, dtype=None, shape=None, device=None, op=None, root=self.root,
                             scales=None, splits=self.splits, group=self.group, priority=None)
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
                            splits=None, group=None, priority=None)
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

    def __repr__(self) -> str:
        return f"Response({self.name!r}, {self.kind.value}, error={self.error!r})"


_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}
