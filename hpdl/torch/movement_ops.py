"""The collectives that move data without reducing it: allgather, broadcast and alltoall (see
mpi_ops.py for the contract every collective follows). Their gradients are reductions
(allreduce_ops.py)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from hpdl.engine import Request, RequestKind
from hpdl.torch import runtime
from hpdl.torch.allreduce_ops import allreduce_async, grouped_allreduce_async
from hpdl.torch.calls import (
    AsyncHandle, Average, allgather_request, call_name, check_dtypes, contiguous, first_result, in_place_target,
    submit, synchronize,
)
from hpdl.torch.process_sets import ProcessSet, global_process_set, process_set_id


# -- allgather ---------------------------------------------------------------------------------

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
    handle = submit(allgather_request(tensor, call_name("allgather", name, process_set), process_set))
    return AsyncHandle([handle], first_result)


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
    base = call_name("grouped_allgather", name, process_set)
    tensors = list(tensors)
    check_dtypes(tensors, "grouped_allgather", base)
    handles = [submit(allgather_request(t, f"{base}.{i}", process_set, group=(base, len(tensors))))
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
    source = contiguous(tensor, "broadcast")
    output = torch.empty_like(source)
    request = Request(RequestKind.BROADCAST, call_name("broadcast", name, process_set), tensor=source, output=output,
                      root=_set_root(root_rank, process_set), process_set_id=process_set_id(process_set))
    return AsyncHandle([submit(request)], first_result)


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
    work, write_back = in_place_target(tensor)
    request = Request(RequestKind.BROADCAST, call_name("broadcast", name, process_set), tensor=work, output=work,
                      root=_set_root(root_rank, process_set), process_set_id=process_set_id(process_set))
    return AsyncHandle([submit(request)], lambda results: write_back(results[0]))


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
    tensor = contiguous(tensor, "alltoall")
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
    request = Request(RequestKind.ALLTOALL, call_name("alltoall", name, process_set), tensor=tensor, splits=split_tuple,
                      process_set_id=process_set_id(process_set))
    return AsyncHandle([submit(request)], first_result)


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


