"""The collectives of ``hpdl.torch``, by Horovod's names: each call becomes an engine request.

``*_async`` functions return a handle at once; ``poll(handle)`` tells whether it finished and
``synchronize(handle)`` waits and returns the result. The synchronous functions are the async
ones plus a wait; the ones without a trailing underscore are differentiable.
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
    """``op`` as an Op: an Op itself, or Horovod's number for it (``hvd.Sum`` is 1 there)."""
    if isinstance(op, Op):
        return op
    if isinstance(op, int) and not isinstance(op, bool) and op in _OPS_BY_NUMBER:
        return _OPS_BY_NUMBER[op]
    raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Adasum, Min, Max or Product")


def check_adasum_ranks(process_set: ProcessSet) -> None:
    """Refuse Adasum among a number of ranks that is not a power of two, as Horovod does."""
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
    """Return True once the asynchronous operation behind ``handle`` has finished."""
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
    """Wait for ``handle`` and return the operation's result (raising its error, if any)."""
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
    """Start reducing ``tensor`` across ranks into a new tensor; return a handle."""
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
    """Start reducing ``tensor`` in place; return a handle.

    ``priority`` (hpdl's own; lower is sooner, the same on every rank): once agreed, the
    allreduce waits to start in priority order as the backend has room (DistributedOptimizer's
    ``overlap_forward`` uses it so that the first layers' gradients travel first).
    ``bytes_to_come`` (hpdl's own, a hint): how many bytes of allreduces this caller will submit
    right after this one (DistributedOptimizer: the step's gradients not yet made), so that
    the engine does not hold the last ones back to gather them (engine.py, Gathering).
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
    """Reduce ``tensor`` across ranks (Average by default); differentiable."""
    op = _resolve_op(average, op)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, op, name, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[Op] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place and return it."""
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
    """Start reducing a list of tensors as one unit (negotiated and fused together)."""
    return _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average=None, name=None, op=None,
                             prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                             bytes_to_come: Optional[int] = None) -> AsyncHandle:
    """Start reducing a list of tensors in place as one unit (``bytes_to_come``: as for
    allreduce_async_, the bytes to be submitted after the whole group)."""
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
    """Reduce a list of tensors as one unit; differentiable."""
    op = _resolve_op(average, op)
    packed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(op, name, prescale_factor, postscale_factor, process_set, *[t for t, _ in packed])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, packed)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> List[torch.Tensor]:
    """Reduce a list of tensors in place as one unit."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Optional[Op] = None,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse tensor (by allgathering indices and values); return a callable
    that waits and gives the coalesced result."""
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
    """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""
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
    """Concatenate every rank's ``tensor`` along dim 0; differentiable."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start allgathering a list of tensors as one unit."""
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
    """Allgather a list of tensors as one unit; differentiable."""
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
    """Start copying root's ``tensor`` to every rank into a new tensor."""
    source = _contiguous(tensor, "broadcast")
    output = torch.empty_like(source)
    request = Request(RequestKind.BROADCAST, _name("broadcast", name), tensor=source, output=output,
                      root=_set_root(root_rank, process_set), process_set_id=process_set_id(process_set))
    return AsyncHandle([_submit(request)], _first)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start overwriting ``tensor`` with root's, in place."""
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
    """Return root's ``tensor`` on every rank; differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with root's, in place, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ----------------------------------------------------------------------------------

def alltoall_async(tensor: torch.Tensor, splits: Union[None, Sequence[int], torch.Tensor] = None,
                   name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> AsyncHandle:
    """Start sending ``splits[r]`` rows of ``tensor`` to each rank r (even split by default)."""
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
    """Exchange rows between ranks; differentiable. Returns ``(output, received_splits)`` when
    ``splits`` is given, else the output alone (as Horovod)."""
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
    """Start reducing ``tensor`` across ranks, each rank keeping its block of rows."""
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
    """Reduce across ranks and keep this rank's block of rows; differentiable."""
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None, op: Op = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> AsyncHandle:
    """Start reduce-scattering a list of tensors as one unit."""
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
    """Reduce-scatter a list of tensors as one unit; differentiable."""
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

    Args:
        device: the GPU on which to make the zeros for CUDA tensors; -1 (Horovod's default):
            this thread's current GPU where CUDA is in use (``torch.cuda.set_device``).

    Returns:
        the rank of the last process that joined.
    """
    if device < 0 and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()  # the engine's thread has a current device of its own
    # ``root`` carries the GPU, as it carries a process set's id in REMOVE_PROCESS_SET.
    return _submit(Request(RequestKind.JOIN, "join", root=int(device))).wait()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` has reached the barrier."""
    set_id = process_set_id(process_set)
    _submit(Request(RequestKind.BARRIER, _name(f"barrier.{set_id}", None), process_set_id=set_id)).wait()
