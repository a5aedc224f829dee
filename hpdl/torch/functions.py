"""Training helpers: broadcast parameters and optimizer state (Horovod's ``horovod/torch/functions.py``).

Horovod's module holds the object collectives too; they live in object_ops.py (which
optimizer_base.py, beneath this module, uses as well) and are importable from here as there.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from hpdl.torch import runtime
from hpdl.torch.mpi_ops import broadcast_async_, synchronize
from hpdl.torch.object_ops import allgather_object, broadcast_object
from hpdl.torch.optimizer_base import local_step
from hpdl.torch.process_sets import ProcessSet, global_process_set

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(params, root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite parameters on every rank with root's, in place.

    Args:
        params: a ``state_dict()``, a dict (broadcast in sorted key order), or a list of tensors
            or ``(name, tensor)`` pairs (e.g. ``model.named_parameters()`` as a list).
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}: expected a dict or a list")
    _broadcast_tensors([(name, t) for name, t in items if torch.is_tensor(t)], root_rank, process_set,
                       "broadcast_parameters")


def _broadcast_tensors(items: List[Tuple[Optional[str], torch.Tensor]], root_rank: int, process_set: ProcessSet,
                       what: str) -> None:
    _check_same_tensors(items, root_rank, process_set, what)
    handles = [broadcast_async_(tensor, root_rank, name=f"broadcast_parameters.{name}" if name else None,
                                process_set=process_set) for name, tensor in items]
    for handle in handles:
        synchronize(handle)


def _check_same_tensors(items: List[Tuple[Optional[str], torch.Tensor]], root_rank: int, process_set: ProcessSet,
                        what: str) -> None:
    """Raise ValueError on every rank when some rank's tensors (names, shapes) are not root's.

    Otherwise a tensor that only some ranks have would be broadcast by them alone, and they
    would wait for the others until the stall timeout."""
    if runtime.size() == 1:
        return
    mine = [(name, tuple(tensor.shape)) for name, tensor in items]
    if all(name is not None for name, _ in mine):
        mine.sort()  # named broadcasts are matched by name, in any order
    everyone = allgather_object(mine, name=f"{what}.tensors", process_set=process_set)
    ranks = list(process_set.ranks) if process_set.ranks is not None else list(range(len(everyone)))
    if root_rank not in ranks:
        return  # broadcast_async_ names the bad root itself
    root = everyone[ranks.index(root_rank)]
    problems = [f"rank {rank} {_difference(theirs, root)}" for rank, theirs in zip(ranks, everyone) if theirs != root]
    if problems:
        more = f"; and {len(problems) - 3} more rank(s)" if len(problems) > 3 else ""
        raise ValueError(f"{what}: the ranks' tensors differ from root rank {root_rank}'s: "
                         + "; ".join(problems[:3]) + more)


def _difference(theirs: List[Tuple[Optional[str], Tuple[int, ...]]],
                root: List[Tuple[Optional[str], Tuple[int, ...]]]) -> str:
    """How one rank's (name, shape) list differs from root's, in words."""
    def listed(names: List[str]) -> str:
        return ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    if any(name is None for name, _ in theirs + root):
        if len(theirs) != len(root):
            return f"has {len(theirs)} tensors, root has {len(root)}"
        index = next(i for i, (a, b) in enumerate(zip(theirs, root)) if a != b)
        return f"has shape {list(theirs[index][1])} at position {index}, root has {list(root[index][1])}"
    their_shapes, root_shapes = dict(theirs), dict(root)
    extra = [n for n in their_shapes if n not in root_shapes]
    missing = [n for n in root_shapes if n not in their_shapes]
    parts = []
    if extra:
        parts.append(f"has {listed(extra)}, which root lacks")
    if missing:
        parts.append(f"lacks {listed(missing)}")
    for name, shape in their_shapes.items():
        if name in root_shapes and root_shapes[name] != shape:
            parts.append(f"has {name!r} of shape {list(shape)}, root's is {list(root_shapes[name])}")
            break
    return ", ".join(parts) or "names a tensor twice"


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state (tensors in place, scalars and options as objects) equal root's.

    A fresh optimizer has no state yet: it is created first by a step with zero gradients (on
    the wrapped optimizer, without allreduce, for a DistributedOptimizer), as Horovod does,
    and every parameter that requires a gradient is left with one: the gradient it had (which
    differs between ranks), or else the zeros of that step, as Horovod leaves them (a script
    may broadcast or read them next). The parameters' values are put back after the step
    (weight decay moves them even with zero gradients, and only the ranks with a fresh
    optimizer take the step, so the parameters broadcast before would differ).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        kept: Dict[torch.Tensor, Optional[torch.Tensor]] = {}
        values: Dict[torch.Tensor, torch.Tensor] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p not in kept:
                    kept[p] = p.grad
                    values[p] = p.detach().clone()
                    p.grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam):  # it refuses dense gradients
                        p.grad = p.grad.to_sparse()
        try:
            local_step(optimizer)  # a DistributedOptimizer's without the allreduce
        finally:
            with torch.no_grad():
                for p, value in values.items():
                    p.copy_(value)
            for p, grad in kept.items():
                if grad is not None:
                    p.grad = grad
        state_dict = optimizer.state_dict()

    tensors: List[Tuple[str, torch.Tensor]] = []
    scalars: Dict[str, Any] = {}
    params_by_id = {}
    for index, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key != "params":
                scalars[f"group.{index}.{key}"] = value
        for position, p in enumerate(group["params"]):
            params_by_id[(index, position)] = p
    for index, group in enumerate(state_dict["param_groups"]):
        for position, pid in enumerate(group["params"]):
            for key, value in state_dict["state"].get(pid, {}).items():
                label = f"state.{index}.{position}.{key}"
                if torch.is_tensor(value):
                    tensors.append((label, value))
                else:
                    scalars[label] = value
    _broadcast_tensors(tensors, root_rank, process_set, "broadcast_optimizer_state")
    scalars = broadcast_object(scalars, root_rank, name="optimizer_scalars", process_set=process_set)
    for label, value in scalars.items():
        parts = label.split(".")
        if parts[0] == "group":
            optimizer.param_groups[int(parts[1])][".".join(parts[2:])] = value
        else:
            p = params_by_id[(int(parts[1]), int(parts[2]))]
            optimizer.state[p][".".join(parts[3:])] = value
