"""reducescatter, single and grouped (see mpi_ops.py for the contract every collective follows);
its gradient is an allgather (movement_ops.py)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from hpdl.engine import HorovodInternalError, Op, Request, RequestKind
from hpdl.torch.calls import (
    Adasum, AsyncHandle, Average, Sum, call_name, check_dtypes, contiguous, first_result, resolve_op, submit,
    synchronize,
)
from hpdl.torch.compression import Compression
from hpdl.torch.movement_ops import grouped_allgather_async
from hpdl.torch.process_sets import ProcessSet, global_process_set, process_set_id


# -- reducescatter -----------------------------------------------------------------------------

def _reducescatter_request(tensor, name, op, prescale, postscale, process_set, group=None) -> Request:
    tensor = contiguous(tensor, "reducescatter")
    if tensor.dim() == 0:  # a ValueError, as Horovod's ("Reducescatter does not support scalar inputs")
        raise ValueError(f"reducescatter of tensor {name!r}: scalars (0-d tensors) cannot be scattered")
    return Request(RequestKind.REDUCESCATTER, name, tensor=tensor, op=op, prescale=float(prescale),
                   postscale=float(postscale), process_set_id=process_set_id(process_set), group=group)


def _resolve_scatter_op(op: Optional[Op]) -> Op:
    op = resolve_op(None, op)
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
    request = _reducescatter_request(tensor, call_name("reducescatter", name, process_set), op, prescale_factor,
                                     postscale_factor, process_set)
    return AsyncHandle([submit(request)], first_result)


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
    base = call_name("grouped_reducescatter", name, process_set)
    tensors = list(tensors)
    check_dtypes(tensors, "grouped_reducescatter", base)
    # Every member is checked before any is submitted: a half-submitted group would hang the peers.
    requests = [_reducescatter_request(t, f"{base}.{i}", op, prescale_factor, postscale_factor, process_set,
                                       group=(base, len(tensors))) for i, t in enumerate(tensors)]
    return AsyncHandle([submit(request) for request in requests], lambda results: list(results))


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


