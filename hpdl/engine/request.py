"""What the engine is asked to do (requests) and what the ranks agreed to do (responses)."""

from __future__ import annotations

import enum
from typing import Any, Optional, Tuple

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


class Request:
    """One named collective submitted by this rank.

    ``tensor`` is this rank's input (contiguous); ``output`` receives the result in place for
    allreduce and broadcast (it may be ``tensor`` itself); other kinds allocate their output.
    ``group`` = (group name, member count) asks that all members be negotiated and fused
    together. ``priority`` (an allreduce's; lower runs sooner) holds it back once agreed, to
    start in priority order as the backend has room (see engine.py, Priorities).
    ``bytes_to_come`` (an allreduce's, optional) is how many bytes the caller will submit right
    after it in the same burst (DistributedOptimizer: the step's gradients not yet made); it
    ends a gathering early, so that the last gradients are not held back together (see
    engine.py, Gathering). It is a local hint, not part of the signature. A plain class with
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
        self.arrival = 0.0  # time.monotonic() when the engine thread took it from the queue
        self._signature: Optional[Tuple[Any, ...]] = None

    def signature(self) -> Tuple[Any, ...]:
        """What must agree across ranks, as a hashable tuple (also the response-cache key part).

        For allgather and alltoall only the trailing dimensions must agree; the first dimension
        and the splits still belong to the signature so that a change invalidates the cache.
        """
        sig = self._signature
        if sig is None:
            sig = self._signature = self._make_signature()
        return sig

    def _make_signature(self) -> Tuple[Any, ...]:
        # Enum's .value is a descriptor call; ._value_ is the plain attribute behind it, and
        # this runs once per tensor per step.
        t = self.tensor
        kind = self.kind
        if t is None:
            return (kind._value_, None, None, None, None, self.root, None, self.splits, self.group, None)
        reduces = kind is RequestKind.ALLREDUCE or kind is RequestKind.REDUCESCATTER
        return (
            kind._value_,
            dtype_name(t.dtype),
            tuple(t.shape),
            "cpu" if t.is_cpu else t.device.type,
            self.op._value_ if reduces else None,
            self.root if kind is RequestKind.BROADCAST else None,
            (self.prescale, self.postscale) if reduces else None,
            self.splits,
            self.group,
            self.priority,
        )

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()


# Positions of the fields within Request.signature(), for validation messages.
SIG_KIND, SIG_DTYPE, SIG_SHAPE, SIG_DEVICE, SIG_OP, SIG_ROOT, SIG_SCALES, SIG_SPLITS, SIG_GROUP, SIG_PRIORITY = range(10)


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

    def __init__(self, name: str, kind: RequestKind, signatures: Tuple[Optional[Tuple[Any, ...]], ...],
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
            sig = (kind.value, None, None, None, None, None, None, None, None, None)
        self.signature = sig
        numel = 0
        if sig[SIG_SHAPE] is not None:
            numel = 1
            for d in sig[SIG_SHAPE]:
                numel *= d
        self.numel = numel
        self.nbytes = numel * _ITEMSIZE.get(sig[SIG_DTYPE], 0)
        self.group = sig[SIG_GROUP]
        self.priority = sig[SIG_PRIORITY] if len(sig) > SIG_PRIORITY else None
        # Responses with equal keys may share one fused allreduce.
        self.fusion_key = (sig[SIG_DTYPE], sig[SIG_DEVICE], sig[SIG_OP], sig[SIG_SCALES], joined)

    def __repr__(self) -> str:
        return f"Response({self.name!r}, {self.kind.value}, error={self.error!r})"


_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}
