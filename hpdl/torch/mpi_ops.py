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

Where the calls live: calls.py (what they share: ops, names, refusals, handles), allreduce_ops.py,
movement_ops.py (allgather, broadcast, alltoall), reducescatter_ops.py; this module gathers them
under Horovod's module name and holds join and barrier.
"""

from __future__ import annotations

import torch

from hpdl.engine import Request, RequestKind
from hpdl.torch.allreduce_ops import (
    allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce, grouped_allreduce_,
    grouped_allreduce_async, grouped_allreduce_async_, sparse_allreduce_async,
)
from hpdl.torch.calls import (
    Adasum, AsyncHandle, Average, Max, Min, Product, Sum, as_op, call_name, check_adasum_ranks, poll, submit,
    synchronize, wait_done,
)
from hpdl.torch.movement_ops import (
    allgather, allgather_async, alltoall, alltoall_async, broadcast, broadcast_, broadcast_async,
    broadcast_async_, grouped_allgather, grouped_allgather_async,
)
from hpdl.torch.process_sets import ProcessSet, global_process_set, process_set_id
from hpdl.torch.reducescatter_ops import (
    grouped_reducescatter, grouped_reducescatter_async, reducescatter, reducescatter_async,
)

__all__ = ["Adasum", "AsyncHandle", "Average", "Max", "Min", "Product", "Sum", "allgather", "allgather_async",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "as_op",
           "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "check_adasum_ranks",
           "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
           "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
           "grouped_reducescatter_async", "join", "poll", "reducescatter", "reducescatter_async",
           "sparse_allreduce_async", "synchronize", "wait_done"]


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
    return submit(Request(RequestKind.JOIN, "join", join_device=int(device))).wait()


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
    submit(Request(RequestKind.BARRIER, call_name(f"barrier.{set_id}", None), process_set_id=set_id)).wait()
