"""The collectives of ``hpdl.torch``, by Horovod's names: each call becomes an engine request.

Matching by name. A collective runs once every rank of its process set has submitted a request
of the same name; the ranks may submit their requests in different orders, and the engine
negotiates which ones all of them have. A call without ``name`` gets one from a counter kept per
kind of call (``allreduce.noname.1``, ``allreduce.noname.2``, ...), so every rank must make its
unnamed calls of each kind in the same order. The requests of one name must agree on every rank:
the operation, dtype, device, shape (the whole shape for allreduce, broadcast and reducescatter;
all but the first dimension for allgather and alltoall), op, root rank, scale factors and group.
A mismatch fails the call on every rank with ``HorovodInternalError``, naming the tensor, what
differs and on which ranks.

Handles. The ``*_async`` functions return a handle at once; ``poll(handle)`` tells whether the
operation has finished and ``synchronize(handle)`` waits for it and returns its result, or raises
its error. The other functions are their async counterpart followed by ``synchronize``. Those
without a trailing underscore return new tensors and are differentiable; those with one
(``allreduce_``, ``broadcast_``, ...) write the result into the tensor given and return it. A
name is in flight on a rank from its submission until its handle completes; submitting it again
meanwhile raises ``ValueError``.

Process sets. ``process_set`` (default ``hvd.global_process_set``, every rank) restricts a call to
the ranks of a set registered with ``hvd.add_process_set``; every member must make the call, and a
rank outside the set may not. ``root_rank`` is a global rank, also in a process set.

Errors. Refusals are raised on the calling rank before anything is negotiated: ``ValueError``
(hpdl not initialized; a dtype no collective takes; a name already in flight; a process set not
registered, or one this rank is not in; the arguments described under each function),
``NotImplementedError`` (Adasum among a number of ranks that is no power of two) and
``HorovodInternalError`` (Adasum of a tensor that is not floating-point, reducescatter with
Adasum, and any call after the engine has failed or another rank has shut it down). What fails
once submitted (calls the ranks disagree on, a stall past ``HPDL_STALL_TIMEOUT``, a lost rank, a
backend error, another rank's ``shutdown()``) is raised by ``synchronize`` as
``HorovodInternalError``, a ``RuntimeError``, on every rank concerned. See docs/api.md for where
hpdl differs from Horovod.
"""

from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from hpdl.comm import dtypes
from hpdl.engine import Handle, HorovodInternalError, Op, Request, RequestKind
from hpdl.torch import runtime
from hpdl.torch.compression import Compression
from hpdl.torch.process_sets import ProcessSet, global_process_set, process_set_id
from hpdl.torch.streams import after_engine, before_engine

Average, Sum, Adasum, Min, Max, Product = Op.AVERAGE, Op.SUM, Op.ADASUM, Op.MIN, Op.MAX, Op.PRODUCT

# Horovod's ops are the integers of its C++ enum ReduceOp (message.h); scripts that pass those
# numbers, or keep an op as an int, get the same reduction here.
_OPS_BY_NUMBER = {0: Average, 1: Sum, 2: Adasum, 3: Min, 4: Max, 5: Product}

_counters: Dict[str, itertools.count] = defaultdict(lambda: itertools.count(1))


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


def _name(kind: str, name: Optional[str]) -> str:
    # Unnamed ops get a per-kind counter: ranks issuing them in the same order agree on names.
    return name if name is not None else f"{kind}.noname.{next(_counters[kind])}"


def _resolve_op(average: Optional[bool], op: Optional[Op]) -> Op:
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


def _check_adasum(tensor: torch.Tensor, name: str, process_set: ProcessSet) -> None:
    check_adasum_ranks(process_set)
    if not tensor.dtype.is_floating_point:
        # Horovod fails such a tensor in its Adasum operation ("Unsupported data type"), and
        # synchronize() raises that as HorovodInternalError; here it is refused before anything
        # is negotiated, with the same type.
        raise HorovodInternalError(f"allreduce of tensor {name!r}: Adasum reduces floating-point tensors only, "
                                   f"got {str(tensor.dtype).replace('torch.', '')}")


def _submit(request: Request) -> Handle:
    engine = runtime.engine()  # raises the "not initialized" error
    tensor = request.tensor
    if tensor is not None:
        if tensor.dtype not in dtypes.SUPPORTED:
            _refuse_dtype(tensor, request.kind.value, request.name)
        if tensor.is_cuda:
            before_engine(tensor, request.output)
    return engine.submit(request)


def _refuse_dtype(tensor: torch.Tensor, what: str, name: str) -> None:
    # A ValueError on the calling rank, before anything is negotiated (as Horovod).
    supported = ", ".join(sorted(dtypes.DTYPES))
    raise ValueError(f"{what} of tensor {name!r}: dtype {dtypes.dtype_name(tensor.dtype)} is not "
                     f"supported (supported: {supported})")


def _check_dtypes(tensors: Sequence[torch.Tensor], what: str, base: str) -> None:
    """Refuse a group before any of it is submitted (a half-submitted group would hang the peers)."""
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, torch.Tensor) and tensor.dtype not in dtypes.SUPPORTED:
            _refuse_dtype(tensor, what, f"{base}.{i}")


def _contiguous(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _in_place(tensor: torch.Tensor) -> Tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """A contiguous target for an in-place op and the step that writes the result back."""
    # Write through a detached view: parameters are leaves that require grad, and the engine's
    # write is not part of any autograd graph.
    base = tensor.detach() if tensor.requires_grad else tensor
    if base.is_contiguous():
        return base, _returning(tensor)
    work = base.contiguous()
    return work, lambda out: (base.copy_(out), tensor)[1]


def _returning(tensor: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    return lambda _out: tensor


def _byte_count(bytes_to_come: Any, name: str) -> int:
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


def _first(results: List[Any]) -> Any:
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
    """
    if handle.finish is None:
        handle.handles[0].wait()
        return after_engine(handle.inplace)
    return after_engine(handle.finish([h.wait() for h in handle.handles]))


# -- allreduce ---------------------------------------------------------------------------------

def _allreduce_request(tensor, output, name, op, prescale, postscale, process_set, group=None,
                       priority=None, bytes_to_come=None) -> Request:
    if op is Adasum:
        _check_adasum(tensor, name, process_set)
    return Request(RequestKind.ALLREDUCE, name, tensor=tensor, output=output, op=op, prescale=float(prescale),
                   postscale=float(postscale), process_set_id=process_set_id(process_set), group=group,
                   priority=priority, bytes_to_come=bytes_to_come)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[Op] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start reducing ``tensor`` over the ranks into a new tensor; return a handle at once.

    Args:
        tensor: The tensor to reduce, of the same shape, dtype and device on every rank. It is
            read when the reduction runs: leave it unchanged until ``synchronize``.
        average: Horovod's deprecated switch: True means ``op=Average``, False ``op=Sum``.
            Give ``op`` or ``average``, not both.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        op: ``hvd.Average`` (the default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``, or
            Horovod's integer for one (``Average`` 0 ... ``Product`` 5). Average divides the sum by
            the number of ranks; integer tensors get the exact quotient truncated toward zero.
            Adasum combines floating-point tensors among a power-of-two number of ranks.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.

    Returns:
        A handle for ``poll`` and ``synchronize``; ``synchronize`` returns a new tensor of
        ``tensor``'s shape and dtype holding the reduction.

    Raises:
        ValueError: ``op`` and ``average`` both given, an unknown ``op``, an unsupported
            dtype, or a name already in flight.
        NotImplementedError: Adasum among a number of ranks that is no power of two.
        HorovodInternalError: Adasum of a tensor that is not floating-point; from ``synchronize``,
            a call the ranks disagree on (shape, dtype, op, scale factors, ...), a stall or a lost
            rank.
    """
    op = _resolve_op(average, op)
    source = _contiguous(tensor, "allreduce")
    output = torch.empty_like(source)
    handle = _submit(_allreduce_request(source, output, _name("allreduce", name), op, prescale_factor,
                                        postscale_factor, process_set))
    return AsyncHandle([handle], _first)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[Op] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set, priority: Optional[int] = None,
                     bytes_to_come: Optional[int] = None) -> AsyncHandle:
    """Start reducing ``tensor`` over the ranks in place; return a handle at once.

    Args:
        tensor: The tensor to reduce and overwrite with the result, of the same shape, dtype and
            device on every rank. Leave it alone until ``synchronize``.
        average: Horovod's deprecated switch: True means ``op=Average``, False ``op=Sum``.
            Give ``op`` or ``average``, not both.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        op: ``hvd.Average`` (the default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``, or
            Horovod's integer for one (``Average`` 0 ... ``Product`` 5). Average divides the sum by
            the number of ranks; integer tensors get the exact quotient truncated toward zero.
            Adasum combines floating-point tensors among a power-of-two number of ranks.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.
        priority: hpdl's own. Lower is sooner; the same on every rank. Once agreed, the allreduce
            waits to start in priority order as the backend has room (``HPDL_PRIORITY_WINDOW``):
            DistributedOptimizer's ``overlap_forward`` uses it so that the first layers' gradients
            travel first.
        bytes_to_come: hpdl's own, a hint: how many bytes of allreduces this caller will submit
            right after this one (DistributedOptimizer: the step's gradients not yet made), so that
            the engine does not hold the last ones back to gather them (``HPDL_GATHER_BYTES``;
            hpdl/engine/scheduling.py, "Gathering").

    Returns:
        A handle for ``poll`` and ``synchronize``; ``synchronize`` returns ``tensor``, holding
        the reduction.

    Raises:
        ValueError: ``op`` and ``average`` both given, an unknown ``op``, an unsupported
            dtype, a name already in flight, or a ``bytes_to_come`` that is not a whole number
            of bytes, 0 or more.
        NotImplementedError: Adasum among a number of ranks that is no power of two.
        HorovodInternalError: Adasum of a tensor that is not floating-point; from ``synchronize``,
            a call the ranks disagree on (shape, dtype, op, scale factors, ...), a stall or a lost
            rank.
    """
    op = _resolve_op(average, op)
    # This runs once per gradient per step: the common case (contiguous) is kept short.
    work = tensor.detach() if tensor.requires_grad else tensor
    if name is None:
        name = _name("allreduce", None)
    if bytes_to_come is not None:
        bytes_to_come = _byte_count(bytes_to_come, name)
    if op is Adasum:
        _check_adasum(work, name, process_set)
    if work.is_contiguous():
        request = Request(RequestKind.ALLREDUCE, name, work, work, op, prescale_factor, postscale_factor, 0, None,
                          process_set_id(process_set), priority=priority, bytes_to_come=bytes_to_come)
        return AsyncHandle([_submit(request)], None, tensor)
    work, write_back = _in_place(tensor)
    handle = _submit(_allreduce_request(work, work, name, op, prescale_factor, postscale_factor, process_set,
                                        priority=priority, bytes_to_come=bytes_to_come))
    return AsyncHandle([handle], lambda results: write_back(results[0]))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, prescale, postscale, process_set):
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, process_set
        return synchronize(allreduce_async(tensor, None, name, op, prescale, postscale, process_set))

    @staticmethod
    def backward(ctx, grad):
        # The gradient of an allreduce is the allreduce of the gradients (same op and scales).
        reduced = synchronize(allreduce_async(grad.contiguous(), None, None, ctx.op, ctx.prescale, ctx.postscale,
                                              ctx.process_set))
        return reduced, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op: Optional[Op] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks (the average by default) into a new tensor; differentiable.

    The gradient of the result is reduced the same way (same op and scale factors) on its way back.

    Args:
        tensor: The tensor to reduce, of the same shape, dtype and device on every rank.
        average: Horovod's deprecated switch: True means ``op=Average``, False ``op=Sum``.
            Give ``op`` or ``average``, not both.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        compression: ``hvd.Compression.none`` (the default), ``hvd.Compression.fp16`` or
            ``hvd.Compression.bf16`` (floating-point tensors travel as 16-bit values and are cast
            back after), or a ``hvd.Compressor`` of your own.
        op: ``hvd.Average`` (the default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``, or
            Horovod's integer for one (``Average`` 0 ... ``Product`` 5). Average divides the sum by
            the number of ranks; integer tensors get the exact quotient truncated toward zero.
            Adasum combines floating-point tensors among a power-of-two number of ranks.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.

    Returns:
        A new tensor of ``tensor``'s shape and dtype holding the reduction.

    Raises:
        ValueError: ``op`` and ``average`` both given, an unknown ``op``, an unsupported
            dtype, or a name already in flight.
        NotImplementedError: Adasum among a number of ranks that is no power of two.
        HorovodInternalError: Adasum of a tensor that is not floating-point; from ``synchronize``,
            a call the ranks disagree on (shape, dtype, op, scale factors, ...), a stall or a lost
            rank.
    """
    op = _resolve_op(average, op)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, op, name, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[Op] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks in place and return it (not differentiable).

    Args:
        tensor: The tensor to reduce and overwrite, of the same shape, dtype and device on every
            rank.
        average: Horovod's deprecated switch: True means ``op=Average``, False ``op=Sum``.
            Give ``op`` or ``average``, not both.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        op: ``hvd.Average`` (the default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``, or
            Horovod's integer for one (``Average`` 0 ... ``Product`` 5). Average divides the sum by
            the number of ranks; integer tensors get the exact quotient truncated toward zero.
            Adasum combines floating-point tensors among a power-of-two number of ranks.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.

    Returns:
        ``tensor``, holding the reduction.

    Raises:
        ValueError: ``op`` and ``average`` both given, an unknown ``op``, an unsupported
            dtype, or a name already in flight.
        NotImplementedError: Adasum among a number of ranks that is no power of two.
        HorovodInternalError: Adasum of a tensor that is not floating-point; from ``synchronize``,
            a call the ranks disagree on (shape, dtype, op, scale factors, ...), a stall or a lost
            rank.
    """
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _grouped_allreduce(tensors, average, name, op, prescale, postscale, process_set, in_place,
                       bytes_to_come=None) -> AsyncHandle:
    op = _resolve_op(average, op)
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allreduce needs at least one tensor")
    base = _name("grouped_allreduce", name)
    _check_dtypes(tensors, "grouped_allreduce", base)
    requests, finishers = [], []
    hints = [None] * len(tensors)
    if bytes_to_come is not None:  # each member's hint counts the members after it
        after = _byte_count(bytes_to_come, base)
        for i in range(len(tensors) - 1, -1, -1):
            hints[i] = after
            after += tensors[i].numel() * tensors[i].element_size()
    # Every member is checked before any is submitted: a half-submitted group would hang the peers.
    for i, tensor in enumerate(tensors):
        if in_place:
            work, write_back = _in_place(tensor)
            output = work
        else:
            work = _contiguous(tensor, "grouped_allreduce")
            output, write_back = torch.empty_like(work), (lambda out: out)
        requests.append(_allreduce_request(work, output, f"{base}.{i}", op, prescale, postscale, process_set,
                                           group=(base, len(tensors)), bytes_to_come=hints[i]))
        finishers.append(write_back)
    handles = [_submit(request) for request in requests]
    return AsyncHandle(handles, lambda results: [f(r) for f, r in zip(finishers, results)])


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average=None, name=None, op=None,
                            prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> AsyncHandle:
    """Start reducing a list of tensors as one unit into new tensors; return a handle at once.

    Args:
        tensors: The tensors to reduce, a non-empty list; they may differ in shape and dtype.
            They are negotiated as one unit, member ``i`` under the name ``<name>.<i>``, and run
            together (fused where they fit) once every rank has submitted all of them.
        average: Horovod's deprecated switch: True means ``op=Average``, False ``op=Sum``.
            Give ``op`` or ``average``, not both.
        name: The group's name (default: an automatic one); see the module docstring.
        op: ``hvd.Average`` (the default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``, or
            Horovod's integer for one (``Average`` 0 ... ``Product`` 5). Average divides the sum by
            the number of ranks; integer tensors get the exact quotient truncated toward zero.
            Adasum combines floating-point tensors among a power-of-two number of ranks.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.

    Returns:
        A handle; ``synchronize`` returns a list of new tensors, one per member, in order.

    Raises:
        ValueError: an empty list, ``op`` and ``average`` both given, or a member whose
            dtype no collective takes, found before any member is submitted.
        NotImplementedError: Adasum among a number of ranks that is no power of two.
        HorovodInternalError: from ``synchronize``, a group the ranks disagree on (a different
            number of members, or a member's shape, dtype or op): the whole group fails on every
            rank.
    """
    return _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average=None, name=None, op=None,
                             prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                             bytes_to_come: Optional[int] = None) -> AsyncHandle:
    """Start reducing a list of tensors in place as one unit; return a handle at once.

    Args:
        tensors: The tensors to reduce, a non-empty list; they may differ in shape and dtype.
            They are negotiated as one unit, member ``i`` under the name ``<name>.<i>``, and run
            together (fused where they fit) once every rank has submitted all of them.
        average: Horovod's deprecated switch: True means ``op=Average``, False ``op=Sum``.
            Give ``op`` or ``average``, not both.
        name: The group's name (default: an automatic one); see the module docstring.
        op: ``hvd.Average`` (the default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``, or
            Horovod's integer for one (``Average`` 0 ... ``Product`` 5). Average divides the sum by
            the number of ranks; integer tensors get the exact quotient truncated toward zero.
            Adasum combines floating-point tensors among a power-of-two number of ranks.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.
        bytes_to_come: As for ``allreduce_async_``: the bytes to be submitted after the whole
            group.

    Returns:
        A handle; ``synchronize`` returns the list of the tensors given, holding the reductions.

    Raises:
        ValueError: an empty list, ``op`` and ``average`` both given, or a member whose
            dtype no collective takes, found before any member is submitted.
        NotImplementedError: Adasum among a number of ranks that is no power of two.
        HorovodInternalError: from ``synchronize``, a group the ranks disagree on (a different
            number of members, or a member's shape, dtype or op): the whole group fails on every
            rank.
    """
    return _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True,
                              bytes_to_come)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_allreduce_async(tensors, None, name, op, prescale, postscale, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], None, None, op, prescale,
                                                      postscale, process_set))
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average=None, name=None, compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> List[torch.Tensor]:
    """Reduce a list of tensors as one unit into new tensors; differentiable.

    Args:
        tensors: The tensors to reduce, a non-empty list; they may differ in shape and dtype.
            They are negotiated as one unit, member ``i`` under the name ``<name>.<i>``, and run
            together (fused where they fit) once every rank has submitted all of them.
        average: Horovod's deprecated switch: True means ``op=Average``, False ``op=Sum``.
            Give ``op`` or ``average``, not both.
        name: The group's name (default: an automatic one); see the module docstring.
        compression: ``hvd.Compression.none`` (the default), ``hvd.Compression.fp16`` or
            ``hvd.Compression.bf16`` (floating-point tensors travel as 16-bit values and are cast
            back after), or a ``hvd.Compressor`` of your own.
        op: ``hvd.Average`` (the default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``, or
            Horovod's integer for one (``Average`` 0 ... ``Product`` 5). Average divides the sum by
            the number of ranks; integer tensors get the exact quotient truncated toward zero.
            Adasum combines floating-point tensors among a power-of-two number of ranks.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.

    Returns:
        A list of new tensors, one per member, in order.

    Raises:
        ValueError: an empty list, ``op`` and ``average`` both given, or a member whose
            dtype no collective takes, found before any member is submitted.
        NotImplementedError: Adasum among a number of ranks that is no power of two.
        HorovodInternalError: from ``synchronize``, a group the ranks disagree on (a different
            number of members, or a member's shape, dtype or op): the whole group fails on every
            rank.
    """
    op = _resolve_op(average, op)
    packed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(op, name, prescale_factor, postscale_factor, process_set, *[t for t, _ in packed])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, packed)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> List[torch.Tensor]:
    """Reduce a list of tensors in place as one unit and return them (not differentiable).

    Args:
        tensors: The tensors to reduce, a non-empty list; they may differ in shape and dtype.
            They are negotiated as one unit, member ``i`` under the name ``<name>.<i>``, and run
            together (fused where they fit) once every rank has submitted all of them.
        average: Horovod's deprecated switch: True means ``op=Average``, False ``op=Sum``.
            Give ``op`` or ``average``, not both.
        name: The group's name (default: an automatic one); see the module docstring.
        op: ``hvd.Average`` (the default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``, or
            Horovod's integer for one (``Average`` 0 ... ``Product`` 5). Average divides the sum by
            the number of ranks; integer tensors get the exact quotient truncated toward zero.
            Adasum combines floating-point tensors among a power-of-two number of ranks.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.

    Returns:
        The list of the tensors given, holding the reductions.

    Raises:
        ValueError: an empty list, ``op`` and ``average`` both given, or a member whose
            dtype no collective takes, found before any member is submitted.
        NotImplementedError: Adasum among a number of ranks that is no power of two.
        HorovodInternalError: from ``synchronize``, a group the ranks disagree on (a different
            number of members, or a member's shape, dtype or op): the whole group fails on every
            rank.
    """
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Optional[Op] = None,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse tensor by allgathering its indices and values; return a callable.

    DistributedOptimizer uses it for sparse gradients (an embedding's). The two allgathers are one
    group, so a failure leaves neither in flight.

    Args:
        tensor: A sparse COO tensor of the same dense shape on every rank; its non-zero entries
            may differ.
        name: Matches the call across ranks (required); the values travel as ``<name>.values``.
        op: ``hvd.Average`` (the default) or ``hvd.Sum``.
        process_set: The ranks taking part (default: every rank).

    Returns:
        A callable that waits for the allgathers and returns the coalesced sparse sum (divided by
        the set's size for Average).

    Raises:
        ValueError: an op other than Average or Sum.
        HorovodInternalError: from the callable, when the ranks disagree (a rank that reduces the
            same name densely, say) or the job fails.
    """
    op = _resolve_op(None, op)
    if op not in (Average, Sum):
        raise ValueError("sparse allreduce supports Average and Sum only")
    sparse = tensor.coalesce()
    # The indices go under the bare name: a rank that reduces the same name densely (a
    # DistributedOptimizer whose parameter got no sparse gradient there yet) then meets a
    # mismatch error on every rank at once, instead of a stall. The two allgathers are one
    # group, so that the values, which that rank never submits, fail with the indices instead
    # of staying in flight (until the stall timeout ends the job).
    group = (name, 2)
    indices = AsyncHandle([_submit(_allgather_request(sparse.indices().t().contiguous(), name, process_set,
                                                      group))], _first)
    values = AsyncHandle([_submit(_allgather_request(sparse.values().contiguous(), f"{name}.values", process_set,
                                                     group))], _first)

    def result() -> torch.Tensor:
        all_indices, all_values = synchronize(indices), synchronize(values)
        if op == Average:
            all_values = all_values / process_set.size()
        # The indices come from coalesced tensors, so they are valid; saying so also keeps torch
        # from warning on every rank that the checks are "implicitly disabled".
        return torch.sparse_coo_tensor(all_indices.t(), all_values, sparse.shape, check_invariants=False).coalesce()

    return result


# -- allgather ---------------------------------------------------------------------------------

def _allgather_request(tensor, name, process_set, group=None) -> Request:
    tensor = _contiguous(tensor, "allgather")
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return Request(RequestKind.ALLGATHER, name, tensor=tensor, process_set_id=process_set_id(process_set), group=group)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start concatenating every rank's ``tensor`` along dimension 0, in rank order; return a handle.

    Args:
        tensor: This rank's part. The first dimension may differ between ranks; the other
            dimensions, the dtype and the device must agree. A 0-d tensor counts as one element.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        process_set: The ranks taking part (default: every rank); their parts are concatenated in
            the order of their ranks.

    Returns:
        A handle; ``synchronize`` returns a new tensor of shape ``(sum of the ranks' first
        dimensions, *tensor.shape[1:])``.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: a dtype no collective takes, or a name already in flight.
        HorovodInternalError: from ``synchronize``, trailing shapes or dtypes that differ between
            ranks, a rank that has called ``join()``, a stall or a lost rank.
    """
    handle = _submit(_allgather_request(tensor, _name("allgather", name), process_set))
    return AsyncHandle([handle], _first)


def _allgather_grads(grads: Sequence[torch.Tensor], shapes: List[torch.Size],
                     process_set: ProcessSet) -> List[torch.Tensor]:
    """The gradients of allgathered tensors: as Horovod, each output gradient averaged over
    the ranks, of which every rank keeps the rows its own input contributed."""
    reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], op=Average,
                                                  process_set=process_set))
    rows = [shape[0] if len(shape) else 1 for shape in shapes]
    dims = synchronize(allgather_async(torch.tensor([rows]), process_set=process_set))
    offsets = dims[: process_set.rank()].sum(0).tolist()
    return [r.narrow(0, int(offset), n).reshape(shape) for r, offset, n, shape in zip(reduced, offsets, rows, shapes)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.shape, ctx.process_set = tensor.shape, process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        return _allgather_grads([grad], [ctx.shape], ctx.process_set)[0], None, None


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order; differentiable.

    The gradient of a rank's input is, as in Horovod, the average over the ranks of the output's
    gradient, in the rows that rank contributed.

    Args:
        tensor: This rank's part. The first dimension may differ between ranks; the other
            dimensions, the dtype and the device must agree. A 0-d tensor counts as one element.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        process_set: The ranks taking part (default: every rank).

    Returns:
        A new tensor of shape ``(sum of the ranks' first dimensions, *tensor.shape[1:])``.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: a dtype no collective takes, or a name already in flight.
        HorovodInternalError: trailing shapes or dtypes that differ between ranks, a rank that has
            called ``join()``, a stall or a lost rank.
    """
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start allgathering a list of tensors as one unit; return a handle.

    Args:
        tensors: The tensors, each allgathered as by ``allgather_async`` (first dimensions may
            differ between ranks); negotiated as one unit, member ``i`` under ``<name>.<i>``.
        name: The group's name (default: an automatic one); see the module docstring.
        process_set: The ranks taking part (default: every rank).

    Returns:
        A handle; ``synchronize`` returns a list of new tensors, one per member, in order.

    Raises:
        ValueError: a member whose dtype no collective takes, found before any is submitted.
        HorovodInternalError: from ``synchronize``, a group the ranks disagree on: the whole group
            fails on every rank.
    """
    base = _name("grouped_allgather", name)
    tensors = list(tensors)
    _check_dtypes(tensors, "grouped_allgather", base)
    handles = [_submit(_allgather_request(t, f"{base}.{i}", process_set, group=(base, len(tensors))))
               for i, t in enumerate(tensors)]
    return AsyncHandle(handles, lambda results: list(results))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.shapes, ctx.process_set = [t.shape for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_allgather_grads(grads, ctx.shapes, ctx.process_set))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Allgather a list of tensors as one unit; differentiable.

    Args:
        tensors: The tensors, each allgathered as by ``allgather`` (first dimensions may differ
            between ranks); negotiated as one unit, member ``i`` under ``<name>.<i>``.
        name: The group's name (default: an automatic one); see the module docstring.
        process_set: The ranks taking part (default: every rank).

    Returns:
        A list of new tensors, one per member, in order.

    Raises:
        ValueError: a member whose dtype no collective takes, found before any is submitted.
        HorovodInternalError: a group the ranks disagree on: the whole group fails on every rank.
    """
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast ---------------------------------------------------------------------------------

def _set_root(root_rank: int, process_set: ProcessSet) -> int:
    """Translate a global root rank into its rank within the process set."""
    ranks = process_set.ranks if process_set.process_set_id else list(range(runtime.size()))
    if root_rank not in ranks:
        raise ValueError(f"root_rank {root_rank} is not a rank of the process set {ranks}")
    return ranks.index(root_rank)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start copying the root rank's ``tensor`` to every rank, into a new tensor; return a handle.

    Args:
        tensor: The tensor, of the same shape, dtype and device on every rank; only the root's
            values are sent.
        root_rank: The global rank whose tensor every rank receives; a member of ``process_set``.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        process_set: The ranks taking part (default: every rank).

    Returns:
        A handle; ``synchronize`` returns a new tensor holding the root's values.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``root_rank`` is not in ``process_set``, a dtype no collective takes, or a name
            already in flight.
        HorovodInternalError: from ``synchronize``, shapes, dtypes or roots that differ between
            ranks, a rank that has called ``join()``, a stall or a lost rank.
    """
    source = _contiguous(tensor, "broadcast")
    output = torch.empty_like(source)
    request = Request(RequestKind.BROADCAST, _name("broadcast", name), tensor=source, output=output,
                      root=_set_root(root_rank, process_set), process_set_id=process_set_id(process_set))
    return AsyncHandle([_submit(request)], _first)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start overwriting ``tensor`` with the root rank's, in place; return a handle.

    Args:
        tensor: The tensor, of the same shape, dtype and device on every rank; the root's is sent,
            the others' are overwritten.
        root_rank: The global rank whose tensor every rank receives; a member of ``process_set``.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        process_set: The ranks taking part (default: every rank).

    Returns:
        A handle; ``synchronize`` returns ``tensor``, holding the root's values.

    Raises:
        ValueError: ``root_rank`` is not in ``process_set``, a dtype no collective takes, or a name
            already in flight.
        HorovodInternalError: from ``synchronize``, shapes, dtypes or roots that differ between
            ranks, a rank that has called ``join()``, a stall or a lost rank.
    """
    work, write_back = _in_place(tensor)
    request = Request(RequestKind.BROADCAST, _name("broadcast", name), tensor=work, output=work,
                      root=_set_root(root_rank, process_set), process_set_id=process_set_id(process_set))
    return AsyncHandle([_submit(request)], lambda results: write_back(results[0]))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        # As Horovod: the averaged gradient lands on the root; the other ranks' inputs get zero.
        reduced = synchronize(allreduce_async(grad.contiguous(), op=Average, process_set=ctx.process_set))
        if runtime.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return the root rank's ``tensor`` on every rank, as a new tensor; differentiable.

    As in Horovod, the gradient flows back to the root: the root's input gets the average of the
    ranks' output gradients, the other ranks' inputs get zeros.

    Args:
        tensor: The tensor, of the same shape, dtype and device on every rank; only the root's
            values are sent.
        root_rank: The global rank whose tensor every rank receives; a member of ``process_set``.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        process_set: The ranks taking part (default: every rank).

    Returns:
        A new tensor holding the root's values.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``root_rank`` is not in ``process_set``, a dtype no collective takes, or a name
            already in flight.
        HorovodInternalError: shapes, dtypes or roots that differ between ranks, a rank that has
            called ``join()``, a stall or a lost rank.
    """
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with the root rank's, in place, and return it (not differentiable).

    Args:
        tensor: The tensor, of the same shape, dtype and device on every rank.
        root_rank: The global rank whose tensor every rank receives; a member of ``process_set``.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        process_set: The ranks taking part (default: every rank).

    Returns:
        ``tensor``, holding the root's values.

    Raises:
        ValueError: ``root_rank`` is not in ``process_set``, a dtype no collective takes, or a name
            already in flight.
        HorovodInternalError: shapes, dtypes or roots that differ between ranks, a rank that has
            called ``join()``, a stall or a lost rank.
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ----------------------------------------------------------------------------------

def alltoall_async(tensor: torch.Tensor, splits: Union[None, Sequence[int], torch.Tensor] = None,
                   name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start sending ``splits[r]`` rows of ``tensor`` to each rank r of the set; return a handle.

    Rows are taken along dimension 0, in order: the first ``splits[0]`` go to the set's first rank,
    the next ``splits[1]`` to the second, and so on.

    Args:
        tensor: This rank's rows, at least one dimension. Dimension 0 may differ between ranks;
            the other dimensions, the dtype and the device must agree.
        splits: How many rows go to each rank of the set, in rank order: a sequence or a 1-D
            integer tensor of one non-negative entry per rank, summing to ``tensor.shape[0]``.
            Default: equal parts (``tensor.shape[0]`` must then divide by the set's size).
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        process_set: The ranks taking part (default: every rank).

    Returns:
        A handle; ``synchronize`` returns ``(output, received_splits)``: the rows received,
        concatenated in rank order, and how many came from each rank (an int32 tensor).

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: a 0-d tensor; ``splits`` that are not a 1-D tensor of integers, have the wrong
            number of entries, a negative one or the wrong sum; no ``splits`` and a first dimension
            that does not divide by the set's size; a dtype no collective takes; a name in flight.
        HorovodInternalError: from ``synchronize``, trailing shapes or dtypes that differ between
            ranks, a rank that has called ``join()``, a stall or a lost rank.
    """
    tensor = _contiguous(tensor, "alltoall")
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension")
    members = process_set.size()
    if splits is None:
        if tensor.shape[0] % members:
            raise ValueError(f"alltoall without splits needs dim 0 ({tensor.shape[0]}) divisible by the "
                             f"number of ranks ({members})")
        split_tuple = None
    else:
        if isinstance(splits, torch.Tensor) and (splits.dim() != 1 or splits.dtype.is_floating_point
                                                 or splits.dtype.is_complex or splits.dtype == torch.bool):
            # As Horovod (a ValueError): a 1-D tensor of integers; the entries of another would be truncated.
            raise ValueError(f"alltoall splits must be a 1-D tensor of integers, got {splits.dim()}-D "
                             f"{str(splits.dtype).replace('torch.', '')}")
        split_tuple = tuple(int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits))
        if len(split_tuple) != members or any(s < 0 for s in split_tuple) or sum(split_tuple) != tensor.shape[0]:
            raise ValueError(f"alltoall splits {list(split_tuple)} must have {members} non-negative entries "
                             f"summing to dim 0 of the tensor ({tensor.shape[0]})")
    request = Request(RequestKind.ALLTOALL, _name("alltoall", name), tensor=tensor, splits=split_tuple,
                      process_set_id=process_set_id(process_set))
    return AsyncHandle([_submit(request)], _first)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _grad_splits):
        # Send each gradient row back where its input row came from.
        output, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, process_set=ctx.process_set))
        return output, None, None, None


def alltoall(tensor: torch.Tensor, splits: Union[None, Sequence[int], torch.Tensor] = None,
             name: Optional[str] = None, process_set: ProcessSet = global_process_set):
    """Exchange rows between the ranks of the set; differentiable.

    Sends ``splits[r]`` rows of ``tensor`` (along dimension 0, in order) to each rank r of the set;
    the gradient of the output travels back to where each row came from.

    Args:
        tensor: This rank's rows, at least one dimension. Dimension 0 may differ between ranks;
            the other dimensions, the dtype and the device must agree.
        splits: How many rows go to each rank of the set, in rank order: a sequence or a 1-D
            integer tensor of one non-negative entry per rank, summing to ``tensor.shape[0]``.
            Default: equal parts (``tensor.shape[0]`` must then divide by the set's size).
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        process_set: The ranks taking part (default: every rank).

    Returns:
        ``(output, received_splits)`` when ``splits`` is given, else ``output`` alone, as in
        Horovod: the rows received, concatenated in rank order, and how many came from each rank
        (an int32 tensor).

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: a 0-d tensor; ``splits`` that are not a 1-D tensor of integers, have the wrong
            number of entries, a negative one or the wrong sum; no ``splits`` and a first dimension
            that does not divide by the set's size; a dtype no collective takes; a name in flight.
        HorovodInternalError: trailing shapes or dtypes that differ between ranks, a rank that has
            called ``join()``, a stall or a lost rank.
    """
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return (output, received) if splits is not None else output


# -- reducescatter -----------------------------------------------------------------------------

def _reducescatter_request(tensor, name, op, prescale, postscale, process_set, group=None) -> Request:
    tensor = _contiguous(tensor, "reducescatter")
    if tensor.dim() == 0:  # a ValueError, as Horovod's ("Reducescatter does not support scalar inputs")
        raise ValueError(f"reducescatter of tensor {name!r}: scalars (0-d tensors) cannot be scattered")
    return Request(RequestKind.REDUCESCATTER, name, tensor=tensor, op=op, prescale=float(prescale),
                   postscale=float(postscale), process_set_id=process_set_id(process_set), group=group)


def _resolve_scatter_op(op: Optional[Op]) -> Op:
    op = _resolve_op(None, op)
    if op is Adasum:
        # Horovod's enqueue aborts an op other than Average and Sum, which its Python layer
        # raises as HorovodInternalError: scripts catch it as a RuntimeError.
        raise HorovodInternalError("reducescatter supports Average, Sum, Min, Max and Product, not Adasum")
    return op


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Op = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> AsyncHandle:
    """Start reducing ``tensor`` over the ranks, each rank keeping its block of rows; return a handle.

    Args:
        tensor: The tensor to reduce, of the same shape, dtype and device on every rank,
            at least one dimension. Its rows (dimension 0) are split over the set's ranks in order,
            as evenly as possible, the earlier ranks taking one more where they do not divide.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        op: ``hvd.Average`` (the default), ``Sum``, ``Min``, ``Max`` or ``Product`` (not
            Adasum), or Horovod's integer for one.
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).

    Returns:
        A handle; ``synchronize`` returns a new tensor: this rank's block of rows of the reduction.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: a 0-d tensor, an unknown ``op``, a dtype no collective takes, or a name already
            in flight.
        HorovodInternalError: ``op`` is Adasum; from the reduction, shapes, dtypes, ops or scale
            factors that differ between ranks, a rank that has called ``join()``, a stall or a
            lost rank.
    """
    op = _resolve_scatter_op(op)
    request = _reducescatter_request(tensor, _name("reducescatter", name), op, prescale_factor, postscale_factor,
                                     process_set)
    return AsyncHandle([_submit(request)], _first)


def _reducescatter_grads(ctx, grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Horovod's gradient of reducescatter: the allgather of the output gradients, times the
    set's size for Sum (not for Average) and times the prescale and postscale factors."""
    op, prescale, postscale, process_set = ctx.args
    gathered = synchronize(grouped_allgather_async([g.contiguous() for g in grads], process_set=process_set))
    factor = prescale * postscale * (process_set.size() if op == Sum else 1)
    return [g * factor for g in gathered] if factor != 1 else gathered


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale, postscale))

    @staticmethod
    def backward(ctx, grad):
        return _reducescatter_grads(ctx, [grad])[0], None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression=Compression.none,
                  op: Op = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks and keep this rank's block of rows; differentiable.

    As in Horovod, the gradient of the input is the allgather of the blocks' gradients, times the
    set's size for Sum, and times the scale factors.

    Args:
        tensor: The tensor to reduce, of the same shape, dtype and device on every rank,
            at least one dimension. Its rows (dimension 0) are split over the set's ranks in order,
            as evenly as possible, the earlier ranks taking one more where they do not divide.
        name: Matches this call with the other ranks' (see the module docstring). Default: an
            automatic name from the counter of this kind of call.
        compression: ``hvd.Compression.none`` (the default), ``hvd.Compression.fp16`` or
            ``hvd.Compression.bf16`` (floating-point tensors travel as 16-bit values and are cast
            back after), or a ``hvd.Compressor`` of your own.
        op: ``hvd.Average`` (the default), ``Sum``, ``Min``, ``Max`` or ``Product`` (not
            Adasum), or Horovod's integer for one.
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).

    Returns:
        A new tensor: this rank's block of rows of the reduction.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: a 0-d tensor, an unknown ``op``, a dtype no collective takes, or a name already
            in flight.
        HorovodInternalError: ``op`` is Adasum; from the reduction, shapes, dtypes, ops or scale
            factors that differ between ranks, a rank that has called ``join()``, a stall or a
            lost rank.
    """
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None, op: Op = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> AsyncHandle:
    """Start reduce-scattering a list of tensors as one unit; return a handle.

    Args:
        tensors: The tensors, each reduce-scattered as by ``reducescatter_async``; negotiated as
            one unit, member ``i`` under the name ``<name>.<i>``.
        name: The group's name (default: an automatic one); see the module docstring.
        op: ``hvd.Average`` (the default), ``Sum``, ``Min``, ``Max`` or ``Product`` (not
            Adasum), or Horovod's integer for one.
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).

    Returns:
        A handle; ``synchronize`` returns a list of new tensors, this rank's block of each member.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: a 0-d tensor, an unknown ``op``, a dtype no collective takes, or a name already
            in flight.
        HorovodInternalError: ``op`` is Adasum; from the reduction, shapes, dtypes, ops or scale
            factors that differ between ranks, a rank that has called ``join()``, a stall or a
            lost rank.
    """
    op = _resolve_scatter_op(op)
    base = _name("grouped_reducescatter", name)
    tensors = list(tensors)
    _check_dtypes(tensors, "grouped_reducescatter", base)
    # Every member is checked before any is submitted: a half-submitted group would hang the peers.
    requests = [_reducescatter_request(t, f"{base}.{i}", op, prescale_factor, postscale_factor, process_set,
                                       group=(base, len(tensors))) for i, t in enumerate(tensors)]
    return AsyncHandle([_submit(request) for request in requests], lambda results: list(results))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression=Compression.none, op: Op = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0):
    """Reduce-scatter a list of tensors as one unit; differentiable.

    Args:
        tensors: The tensors, each reduce-scattered as by ``reducescatter``; negotiated as one
            unit, member ``i`` under the name ``<name>.<i>``.
        name: The group's name (default: an automatic one); see the module docstring.
        compression: ``hvd.Compression.none`` (the default), ``hvd.Compression.fp16`` or
            ``hvd.Compression.bf16`` (floating-point tensors travel as 16-bit values and are cast
            back after), or a ``hvd.Compressor`` of your own.
        op: ``hvd.Average`` (the default), ``Sum``, ``Min``, ``Max`` or ``Product`` (not
            Adasum), or Horovod's integer for one.
        process_set: The ranks taking part (default: every rank). Every member must make the
            call.
        prescale_factor: Multiplies the tensor before the reduction.
        postscale_factor: Multiplies the result after the reduction (with Average, after the
            division by the number of ranks).

    Returns:
        A list of new tensors, this rank's block of each member.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: a 0-d tensor, an unknown ``op``, a dtype no collective takes, or a name already
            in flight.
        HorovodInternalError: ``op`` is Adasum; from the reduction, shapes, dtypes, ops or scale
            factors that differ between ranks, a rank that has called ``join()``, a stall or a
            lost rank.
    """
    packed = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, process_set,
                                       *[t for t, _ in packed])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(outs, packed)]


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None, None, *_reducescatter_grads(ctx, grads))


# -- join and barrier --------------------------------------------------------------------------

def join(device: int = -1) -> int:
    """Wait until every rank has joined, contributing zeros to the others' allreduces meanwhile.

    A rank that runs out of data calls ``join()``; until the last rank joins, the allreduces the
    other ranks still make (the gradients of their last batches) run with zeros from the joined
    ranks. Any other collective submitted while some rank has joined fails on every rank.

    Args:
        device: The GPU on which to make the zeros for CUDA tensors; -1 (Horovod's default):
            this thread's current GPU where CUDA is in use (``torch.cuda.set_device``).

    Returns:
        The rank of the last process that joined.

    Raises:
        ValueError: hpdl is not initialized.
        HorovodInternalError: the job failed or was shut down while waiting.
    """
    if device < 0 and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()  # the engine's thread has a current device of its own
    # ``root`` carries the GPU, as it carries a process set's id in REMOVE_PROCESS_SET.
    return _submit(Request(RequestKind.JOIN, "join", root=int(device))).wait()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` has reached the barrier.

    Args:
        process_set: The ranks to wait for (default: every rank); every member must call.

    Raises:
        ValueError: hpdl is not initialized, or ``process_set`` is not registered or does not
            hold this rank.
        HorovodInternalError: a stall past ``HPDL_STALL_TIMEOUT``, a lost rank, or hpdl shut down.
    """
    set_id = process_set_id(process_set)
    _submit(Request(RequestKind.BARRIER, _name(f"barrier.{set_id}", None), process_set_id=set_id)).wait()
