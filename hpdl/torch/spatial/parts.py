"""Which tensors are parts of a split feature map: a tensor made by a spatial layer (or by
``SpatialParallel.scatter``) carries its :class:`Part`; element-wise operations pass it on."""

from __future__ import annotations

from typing import Any, Optional

import torch

from hpdl.torch.spatial.geometry import Part

_ATTRIBUTE = "_hpdl_part"
_REPLICATED = "_hpdl_replicated"


def part_of(value: Any) -> Optional[Part]:
    """The part ``value`` holds, or None for anything else (a replicated tensor, a number)."""
    return getattr(value, _ATTRIBUTE, None) if isinstance(value, torch.Tensor) else None


def tagged(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """Mark ``tensor`` as ``part`` (in place; returns it)."""
    setattr(tensor, _ATTRIBUTE, part)
    return tensor


def mark_replicated(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as a whole value, the same on every rank of the group (a model's output
    after global pooling), so that gathering it gives it back instead of its copies side by side."""
    setattr(tensor, _REPLICATED, True)
    return tensor


def is_replicated(value: Any) -> bool:
    """Whether ``value`` was marked by :func:`mark_replicated`."""
    return isinstance(value, torch.Tensor) and getattr(value, _REPLICATED, False)


def tag_outputs(result: Any, part: Part) -> Any:
    """Mark every tensor of ``result`` (a tensor, or a tuple or list of them) whose last two
    dimensions are ``part``'s local size: the outputs of an element-wise operation."""
    size = part.local_size
    if isinstance(result, torch.Tensor):
        if result.dim() >= 2 and tuple(result.shape[-2:]) == size:
            tagged(result, part)
    elif isinstance(result, (tuple, list)):
        for item in result:
            tag_outputs(item, part)
    return result


def with_marks_of(copy: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """``copy`` (of ``original``, on another device, say) marked as ``original`` is: the same
    part, or replicated."""
    part = part_of(original)
    if part is not None:
        tagged(copy, part)
    if is_replicated(original):
        mark_replicated(copy)
    return copy


def map_tensors(value: Any, fn) -> Any:
    """``value`` with ``fn`` applied to each tensor in it (in tuples, named tuples, lists and dicts too)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value
