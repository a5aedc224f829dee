"""The object collectives: ``broadcast_object`` and ``allgather_object`` (Horovod's names).

Any object cloudpickle can serialize travels as bytes in a uint8 tensor through the engine's
broadcast and allgather (the pickling rule is hpdl/comm/objects.py's). In a module of their
own, beneath functions.py and optimizer_base.py, so that both use them from above
(``DistributedOptimizer(groups=N)`` takes rank 0's order of the parameters) and neither
imports the other inside a function.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from hpdl.comm import objects
from hpdl.torch import runtime
from hpdl.torch.mpi_ops import allgather, broadcast_
from hpdl.torch.process_sets import ProcessSet, global_process_set

__all__ = ["allgather_object", "broadcast_object"]

_UNSERIALIZABLE = -1  # the length a rank sends in place of an object it could not serialize


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return root's ``obj`` (anything cloudpickle can serialize) on every rank.

    Without ``name`` the collectives are named ``broadcast_object.*`` whatever ``obj`` is
    (Horovod names them after its type, so the common ``obj if rank == 0 else None`` stalls)."""
    base = f"broadcast_object.{name}" if name else "broadcast_object"
    name = name or type(obj).__name__  # in messages
    error = None
    if runtime.rank() == root_rank:
        payload, error = objects.pickled(obj, f"broadcast_object {name!r} on root rank {root_rank}", by_value=True)
        length = torch.tensor([_UNSERIALIZABLE if payload is None else payload.numel()], dtype=torch.int64)
    else:
        payload, length = None, torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, name=f"{base}.size", process_set=process_set)
    if int(length.item()) == _UNSERIALIZABLE:
        raise ValueError(error or f"broadcast_object {name!r}: root rank {root_rank} could not serialize its object "
                                  "(its own error says why)")
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, name=f"{base}.data", process_set=process_set)
    return obj if runtime.rank() == root_rank else objects.from_tensor(payload)


def allgather_object(obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj`` (serialized as by broadcast_object), in rank order.

    Without ``name`` the collectives are named ``allgather_object.*`` whatever ``obj`` is, so
    ranks holding objects of different types (an int and a float, say) do not stall."""
    base = f"allgather_object.{name}" if name else "allgather_object"
    what = f"allgather_object {name!r}" if name else "allgather_object"  # in messages
    payload, error = objects.pickled(obj, f"{what} on rank {runtime.rank()}", by_value=True)
    size = _UNSERIALIZABLE if payload is None else payload.numel()
    sizes = allgather(torch.tensor([size], dtype=torch.int64), name=f"{base}.sizes",
                      process_set=process_set).tolist()
    if _UNSERIALIZABLE in sizes:
        failed = [r for r, n in zip(process_set.ranks, sizes) if n == _UNSERIALIZABLE]
        who = (f"rank {failed[0]} could not serialize its object" if len(failed) == 1 else
               f"ranks {', '.join(map(str, failed))} could not serialize their objects")
        raise ValueError(error or f"{what}: {who} (the error on each says why)")
    return objects.objects_in(allgather(payload, name=f"{base}.data", process_set=process_set), sizes)
