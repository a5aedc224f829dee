"""allreduce in its forms: async, in place, differentiable, grouped, and sparse (see mpi_ops.py
for the contract every collective follows)."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from hpdl.engine import Op, Request, RequestKind
from hpdl.torch.calls import (
    Adasum, AsyncHandle, Average, Sum, allgather_request, byte_count, call_name, check_adasum, check_dtypes,
    contiguous, first_result, in_place_target, resolve_op, submit, synchronize,
)
from hpdl.torch.compression import Compression
from hpdl.torch.process_sets import ProcessSet, global_process_set, process_set_id


def _allreduce_request(tensor, output, name, op, prescale, postscale, process_set, group=None,
                       priority=None, bytes_to_come=None) -> Request:
    if op is Adasum:
        check_adasum(tensor, name, process_set)
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
    op = resolve_op(average, op)
    source = contiguous(tensor, "allreduce")
    output = torch.empty_like(source)
    handle = submit(_allreduce_request(source, output, call_name("allreduce", name, process_set), op, prescale_factor,
                                        postscale_factor, process_set))
    return AsyncHandle([handle], first_result)


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
    op = resolve_op(average, op)
    # This runs once per gradient per step: the common case (contiguous) is kept short.
    work = tensor.detach() if tensor.requires_grad else tensor
    if name is None:
        name = call_name("allreduce", None, process_set)
    if bytes_to_come is not None:
        bytes_to_come = byte_count(bytes_to_come, name)
    if op is Adasum:
        check_adasum(work, name, process_set)
    if work.is_contiguous():
        request = Request(RequestKind.ALLREDUCE, name, work, work, op, prescale_factor, postscale_factor, 0, None,
                          process_set_id(process_set), priority=priority, bytes_to_come=bytes_to_come)
        return AsyncHandle([submit(request)], None, tensor)
    work, write_back = in_place_target(tensor)
    handle = submit(_allreduce_request(work, work, name, op, prescale_factor, postscale_factor, process_set,
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
    op = resolve_op(average, op)
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
    op = resolve_op(average, op)
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allreduce needs at least one tensor")
    base = call_name("grouped_allreduce", name, process_set)
    check_dtypes(tensors, "grouped_allreduce", base)
    requests, finishers = [], []
    hints = [None] * len(tensors)
    if bytes_to_come is not None:  # each member's hint counts the members after it
        after = byte_count(bytes_to_come, base)
        for i in range(len(tensors) - 1, -1, -1):
            hints[i] = after
            after += tensors[i].numel() * tensors[i].element_size()
    # Every member is checked before any is submitted: a half-submitted group would hang the peers.
    for i, tensor in enumerate(tensors):
        if in_place:
            work, write_back = in_place_target(tensor)
            output = work
        else:
            work = contiguous(tensor, "grouped_allreduce")
            output, write_back = torch.empty_like(work), (lambda out: out)
        requests.append(_allreduce_request(work, output, f"{base}.{i}", op, prescale, postscale, process_set,
                                           group=(base, len(tensors)), bytes_to_come=hints[i]))
        finishers.append(write_back)
    handles = [submit(request) for request in requests]
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
    op = resolve_op(average, op)
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
    op = resolve_op(None, op)
    if op not in (Average, Sum):
        raise ValueError("sparse allreduce supports Average and Sum only")
    sparse = tensor.coalesce()
    # The indices go under the bare name: a rank that reduces the same name densely (a
    # DistributedOptimizer whose parameter got no sparse gradient there yet) then meets a
    # mismatch error on every rank at once, instead of a stall. The two allgathers are one
    # group, so that the values, which that rank never submits, fail with the indices instead
    # of staying in flight (until the stall timeout ends the job).
    group = (name, 2)
    indices = submit(allgather_request(sparse.indices().t().contiguous(), name, process_set, group))
    values = submit(allgather_request(sparse.values().contiguous(), f"{name}.values", process_set, group))

    def result() -> torch.Tensor:
        # One call of two handles: should one fail, neither is in flight when it raises.
        all_indices, all_values = synchronize(AsyncHandle([indices, values], list))
        if op == Average:
            all_values = all_values / process_set.size()
        # The indices come from coalesced tensors, so they are valid; saying so also keeps torch
        # from warning on every rank that the checks are "implicitly disabled".
        return torch.sparse_coo_tensor(all_indices.t(), all_values, sparse.shape, check_invariants=False).coalesce()

    return result


