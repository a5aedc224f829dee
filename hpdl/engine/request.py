"""What the engine is asked to do (requests) and what the ranks agreed to do (responses)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional, Tuple

import torch


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


class Op(enum.Enum):
    """Reductions as the API names them (Average is a sum followed by a scale)."""

    AVERAGE = "average"
    SUM = "sum"
    ADASUM = "adasum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


_DTYPE_NAMES = {}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (cached: it is asked for every request)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


class Request:
    """One named collective submitted by this rank.

    ``tensor`` is this rank's input (contiguous); ``output`` receives the result in place for
    allreduce and broadcast (it may be ``tensor`` itself); other kinds allocate their output.
    ``group`` = (group name, member count) asks that all members be negotiated and fused
    together. A plain class with slots: one is made per tensor per training step.
    """

    __slots__ = ("kind", "name", "tensor", "output", "op", "prescale", "postscale", "root", "splits",
                 "process_set_id", "group", "handle", "_signature")

    def __init__(self, kind: RequestKind, name: str, tensor: Optional[torch.Tensor] = None,
                 output: Optional[torch.Tensor] = None, op: Op = Op.SUM, prescale: float = 1.0,
                 postscale: float = 1.0, root: int = 0, splits: Optional[Tuple[int, ...]] = None,
                 process_set_id: int = 0, group: Optional[Tuple[str, int]] = None):
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
        self.handle = None  # set by the engine at submission
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
        t = self.tensor
        kind = self.kind
        if t is None:
            return (kind.value, None, None, None, None, self.root, None, self.splits, self.group)
        reduces = kind in (RequestKind.ALLREDUCE, RequestKind.REDUCESCATTER)
        return (
            kind.value,
            dtype_name(t.dtype),
            tuple(t.shape),
            t.device.type,
            self.op.value if reduces else None,
            self.root if kind == RequestKind.BROADCAST else None,
            (self.prescale, self.postscale) if reduces else None,
            self.splits,
            self.group,
        )

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()


# Positions of the fields within Request.signature(), for validation messages.
SIG_KIND, SIG_DTYPE, SIG_SHAPE, SIG_DEVICE, SIG_OP, SIG_ROOT, SIG_SCALES, SIG_SPLITS, SIG_GROUP = range(9)


@dataclasses.dataclass
class Response:
    """A collective every member agreed to run now, in the same order on every rank.

    ``signatures[r]`` is member r's request signature (the per-rank first dimensions of an
    allgather and the splits of an alltoall come from there). ``error`` makes every rank fail
    the request with that message instead of running it. ``joined`` lists members that have
    called join() and contribute zeros.
    """

    name: str
    kind: RequestKind
    signatures: Tuple[Tuple[Any, ...], ...]
    error: Optional[str] = None
    joined: Tuple[int, ...] = ()
    last_joined: int = -1
    numel: int = dataclasses.field(init=False, default=0)  # of one member's tensor (allreduce)

    def __post_init__(self) -> None:
        sig = self.signature
        if sig[SIG_SHAPE] is not None:
            n = 1
            for d in sig[SIG_SHAPE]:
                n *= d
            self.numel = n

    @property
    def signature(self) -> Tuple[Any, ...]:
        """The signature of the first member that submitted a request (joined ones did not)."""
        for sig in self.signatures:
            if sig is not None:
                return sig
        return (self.kind.value, None, None, None, None, None, None, None, None)
