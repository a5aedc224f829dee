"""What every collective call of ``hpdl.torch`` shares (mpi_ops.py holds the calls' contract):
the ops, the names of unnamed calls, the refusals made before anything is submitted, the request
builder allgather and sparse allreduce share, and the handles (``poll``, ``wait_done``,
``synchronize``)."""

from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hpdl.comm import dtypes
from hpdl.engine import Handle, HorovodInternalError, Op, Request, RequestKind
from hpdl.torch import runtime
from hpdl.torch.process_sets import ProcessSet, process_set_id
from hpdl.torch.streams import after_engine, before_engine


Average, Sum, Adasum, Min, Max, Product = Op.AVERAGE, Op.SUM, Op.ADASUM, Op.MIN, Op.MAX, Op.PRODUCT


# Horovod's ops are the integers of its C++ enum ReduceOp (message.h); scripts that pass those
# numbers, or keep an op as an int, get the same reduction here.
_OPS_BY_NUMBER = {0: Average, 1: Sum, 2: Adasum, 3: Min, 4: Max, 5: Product}

# The numbers of unnamed calls, per kind and process set: a rank outside a process set makes
# none of its calls, and must not fall behind its members in the names of the others' calls.
# Each init() starts them again, on every rank of the new world alike (an elastic job's new
# workers start from 1, as the survivors then do).
_counters: Dict[Tuple[str, int], itertools.count] = defaultdict(lambda: itertools.count(1))
runtime.add_startup_hook(_counters.clear)


class AsyncHandle:
    """What the ``*_async`` functions return: engine handles plus the step that builds the result.

    ``finish`` turns the handles' results into the caller's result; an in-place operation on a
    contiguous tensor just returns that tensor (``inplace``), the common case kept cheap.
    """

    __slots__ = ("handles", "finish", "inplace")

    def __init__(self, handles: List[Handle], finish: Optional[Callable[[List[Any]], Any]],
                 inplace: Optional[torch.Tensor] = None):
        self.handles = handles
        self.finish = finish
        self.inplace = inplace


def call_name(kind: str, name: Optional[str], process_set: Optional[ProcessSet] = None) -> str:
    """``name``, or for an unnamed call the next of its kind on ``process_set`` (default: every
    rank): ranks issuing them in the same order agree on names."""
    if name is not None:
        return name
    key = (kind, 0 if process_set is None else process_set_id(process_set))
    return f"{kind}.noname.{next(_counters[key])}"


def resolve_op(average: Optional[bool], op: Optional[Op]) -> Op:
    if average is None and isinstance(op, Op) and op is not Adasum:
        return op  # the common case, first: this runs once per tensor per step
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average; give only one of them")
    if op is None:
        op = Average if average is None or average else Sum
    return as_op(op)


def as_op(op: Any) -> Op:
    """``op`` as an Op: an Op itself, or Horovod's number for it (``hvd.Sum`` is 1 there).

    Args:
        op: ``hvd.Average``, ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``, or Horovod's
            integer for one (``Average`` 0, ``Sum`` 1, ``Adasum`` 2, ``Min`` 3, ``Max`` 4,
            ``Product`` 5).

    Raises:
        ValueError: ``op`` is neither an Op nor one of Horovod's numbers 0 to 5.
    """
    if isinstance(op, Op):
        return op
    if isinstance(op, int) and not isinstance(op, bool) and op in _OPS_BY_NUMBER:
        return _OPS_BY_NUMBER[op]
    raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Adasum, Min, Max or Product")


def check_adasum_ranks(process_set: ProcessSet) -> None:
    """Refuse Adasum among a number of ranks that is not a power of two, as Horovod does.

    Args:
        process_set: The ranks that would take part.

    Raises:
        NotImplementedError: ``process_set`` has a number of ranks that is no power of two.
    """
    members = process_set.size()
    if members & (members - 1):
        raise NotImplementedError(f"Adasum needs a power-of-two number of ranks; the process set has {members}")


def check_adasum(tensor: torch.Tensor, name: str, process_set: ProcessSet) -> None:
    check_adasum_ranks(process_set)
    if not tensor.dtype.is_floating_point:
        # Horovod fails such a tensor in its Adasum operation ("Unsupported data type"), and
        # synchronize() raises that as HorovodInternalError; here it is refused before anything
        # is negotiated, with the same type.
        raise HorovodInternalError(f"allreduce of tensor {name!r}: Adasum reduces floating-point tensors only, "
                                   f"got {str(tensor.dtype).replace('torch.', '')}")


def submit(request: Request) -> Handle:
    engine = runtime.engine()  # raises the "not initialized" error
    tensor = request.tensor
    if tensor is not None:
        if tensor.dtype not in dtypes.SUPPORTED:
            refuse_dtype(tensor, request.kind.value, request.name)
        if tensor.is_cuda:
            before_engine(tensor, request.output)
    return engine.submit(request)


def refuse_dtype(tensor: torch.Tensor, what: str, name: str) -> None:
    # A ValueError on the calling rank, before anything is negotiated (as Horovod).
    supported = ", ".join(sorted(dtypes.DTYPES))
    raise ValueError(f"{what} of tensor {name!r}: dtype {dtypes.dtype_name(tensor.dtype)} is not "
                     f"supported (supported: {supported})")


def check_dtypes(tensors: Sequence[torch.Tensor], what: str, base: str) -> None:
    """Refuse a group before any of it is submitted (a half-submitted group would hang the peers)."""
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, torch.Tensor) and tensor.dtype not in dtypes.SUPPORTED:
            refuse_dtype(tensor, what, f"{base}.{i}")


def contiguous(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def in_place_target(tensor: torch.Tensor) -> Tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """A contiguous target for an in-place op and the step that writes the result back."""
    # Write through a detached view: parameters are leaves that require grad, and the engine's
    # write is not part of any autograd graph.
    base = tensor.detach() if tensor.requires_grad else tensor
    if base.is_contiguous():
        return base, returning(tensor)
    work = base.contiguous()
    return work, lambda out: (base.copy_(out), tensor)[1]


def returning(tensor: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    return lambda _out: tensor


def byte_count(bytes_to_come: Any, name: str) -> int:
    """``bytes_to_come`` as an int, or a ValueError naming the collective (a bad hint must
    fail the call, not the engine thread that compares it)."""
    try:
        count = operator.index(bytes_to_come)
    except TypeError:
        count = -1
    if isinstance(bytes_to_come, bool) or count < 0:
        raise ValueError(f"{name}: bytes_to_come must be a whole number of bytes, 0 or more; "
                         f"got {bytes_to_come!r}")
    return count


def first_result(results: List[Any]) -> Any:
    return results[0]


def poll(handle: AsyncHandle) -> bool:
    """Return whether the operation behind ``handle`` has finished (done or failed), without waiting.

    Args:
        handle: What an ``*_async`` function returned.

    Returns:
        True once ``synchronize(handle)`` would return (or raise) at once. ``poll`` never raises
        the operation's error; ``synchronize`` does.
    """
    return all(h.poll() for h in handle.handles)


def wait_done(handle: AsyncHandle) -> None:
    """Block until ``handle``'s operation finished, without building its result or raising its error.

    Waiting on the last of many handles first, then synchronizing them all, wakes the caller
    once instead of once per handle (handles complete roughly in submission order). One of
    the tools beside the engine that docs/api.md documents, for benchmarks and tools.
    """
    for engine_handle in handle.handles:
        engine_handle.wait_done()


def synchronize(handle: AsyncHandle) -> Any:
    """Wait for the operation behind ``handle`` and return its result.

    Args:
        handle: What an ``*_async`` function returned.

    Returns:
        The operation's result, as its async function says: a new tensor, the tensor given (the
        in-place functions), a list of tensors (the grouped ones) or ``(output, received_splits)``
        (``alltoall_async``).

    Raises:
        HorovodInternalError: the operation failed: a call the ranks disagree on, a stall past
            ``HPDL_STALL_TIMEOUT``, a lost rank, a backend error, or hpdl shut down by another rank.
            A grouped call raises once none of its members is in flight, so that a retry under
            the same names is accepted.
    """
    if handle.finish is None:
        handle.handles[0].wait()
        return after_engine(handle.inplace)
    return after_engine(handle.finish(_results(handle.handles)))


def _results(handles: Sequence[Handle]) -> List[Any]:
    """Wait for every handle of one call and return their results, or raise the first error once
    all of them are done.

    A call of several handles (a group's members) that failed leaves none of them in flight when
    it raises, so that the caller's retry under the same names is not refused: the engine fails
    the other members of a failed group too, but maybe a moment later (one still in its queue).
    """
    out = []
    for i, engine_handle in enumerate(handles):
        try:
            out.append(engine_handle.wait())
        except HorovodInternalError:
            for rest in handles[i + 1:]:
                rest.wait_done()
            raise
    return out


def allgather_request(tensor, name, process_set, group=None) -> Request:
    tensor = contiguous(tensor, "allgather")
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return Request(RequestKind.ALLGATHER, name, tensor=tensor, process_set_id=process_set_id(process_set), group=group)

