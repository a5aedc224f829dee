"""Python objects as pickled bytes in uint8 tensors, for the collectives that carry them.

The one way every layer sends objects through collectives: the communicators' own object
collectives (comm/base.py, and the MPI backend's negotiation, comm/mpi.py, in numpy buffers),
``hvd.broadcast_object`` and ``hvd.allgather_object`` (torch/object_ops.py, by value as
Horovod's) and the profile's gather (torch/profiler/session.py). Several objects travel as
their payloads end to end, with their sizes beside them.
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["bytes_to_tensor", "dumps", "from_tensor", "loads", "objects_in", "payloads_in", "pickled", "to_tensor"]


def dumps(obj: Any, by_value: bool = False) -> bytes:
    """``obj`` pickled.

    Args:
        by_value: pickle by cloudpickle, so that lambdas, closures and classes defined in
            ``__main__`` travel by value (the receivers need not import them), as Horovod does.
    """
    if by_value:
        import cloudpickle

        return cloudpickle.dumps(obj)
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    """The object ``data`` holds pickled."""
    return pickle.loads(data)


def to_tensor(obj: Any, by_value: bool = False) -> torch.Tensor:
    """``obj`` pickled (:func:`dumps`) into a uint8 tensor on the CPU."""
    return bytes_to_tensor(dumps(obj, by_value))


def bytes_to_tensor(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor (torch.frombuffer refuses an empty buffer)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def pickled(obj: Any, what: str, by_value: bool = False) -> Tuple[Optional[torch.Tensor], Optional[str]]:
    """``obj`` as :func:`to_tensor` gives it, or None and why it could not be pickled.

    The failure is returned, not raised, so that a rank that cannot send its object still takes
    part in the exchange of sizes (and every rank raises, none waiting for bytes that never come).

    Args:
        what: names the object in the reason (``"broadcast_object 'cfg' on root rank 0"``).
    """
    try:
        return to_tensor(obj, by_value), None
    except Exception as err:  # noqa: BLE001 - pickling raises many types; each becomes one message
        return None, f"{what}: cannot serialize {type(obj).__name__} object: {type(err).__name__}: {err}"


def from_tensor(tensor: torch.Tensor) -> Any:
    """The object whose pickled bytes ``tensor`` holds."""
    return loads(tensor.cpu().numpy().tobytes())


def payloads_in(data: torch.Tensor, sizes: Sequence[int]) -> List[bytes]:
    """The byte strings ``data`` holds end to end, ``sizes[i]`` bytes the i-th."""
    payload = data.cpu().numpy().tobytes()
    out, offset = [], 0
    for size in sizes:
        out.append(payload[offset:offset + size])
        offset += size
    return out


def objects_in(data: torch.Tensor, sizes: Sequence[int]) -> List[Any]:
    """The objects whose pickled bytes ``data`` holds end to end, ``sizes[i]`` bytes the i-th."""
    return [loads(payload) for payload in payloads_in(data, sizes)]
