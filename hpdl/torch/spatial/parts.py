"""Which tensors are parts of a split feature map: a tensor made by a spatial layer (or by
``SpatialParallel.scatter``) carries its :class:`Part`; element-wise operations pass it on.

A part's image dimensions are its last two. A channels-last block (ConvNeXt's
``x.permute(0, 2, 3, 1)``) moves them to the two before the last: such a tensor carries its
part under another mark (:func:`channels_last_part_of`), so that nothing that reads the last
two dimensions as the image's takes it for a part, nor for a whole tensor."""

from __future__ import annotations

from typing import Any, Optional

import torch

from hpdl.torch.spatial.geometry import Part

_ATTRIBUTE = "_hpdl_part"
_REPLICATED = "_hpdl_replicated"
_CHANNELS_LAST = "_hpdl_part_channels_last"
_FLATTENED = "_hpdl_part_flattened"


def part_of(value: Any) -> Optional[Part]:
    """The part ``value`` holds, or None for anything else (a replicated tensor, a number)."""
    return getattr(value, _ATTRIBUTE, None) if isinstance(value, torch.Tensor) else None


def tagged(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """Mark ``tensor`` as ``part`` (in place; returns it)."""
    setattr(tensor, _ATTRIBUTE, part)
    return tensor


def channels_last_part_of(value: Any) -> Optional[Part]:
    """The part ``value`` holds with its image dimensions before the last (..., h, w, C), or None."""
    return getattr(value, _CHANNELS_LAST, None) if isinstance(value, torch.Tensor) else None


def tagged_channels_last(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """Mark ``tensor`` (..., h, w, C) as ``part`` with its image dimensions before the last (in place; returns it)."""
    setattr(tensor, _CHANNELS_LAST, part)
    return tensor


def flattened_part_of(value: Any) -> Optional[Part]:
    """The part ``value`` holds with its image dimensions merged into its last one (``x.flatten(2)``,
    ``x.view(n, c, -1)``), or None."""
    return getattr(value, _FLATTENED, None) if isinstance(value, torch.Tensor) else None


def tagged_flattened(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """Mark ``tensor`` (..., h * w) as ``part`` with its image dimensions merged last (in place; returns it)."""
    setattr(tensor, _FLATTENED, part)
    return tensor


def is_part(value: Any) -> bool:
    """Whether ``value`` is a part of a split map: its image dimensions last, channels-last or merged."""
    return part_of(value) is not None or channels_last_part_of(value) is not None or \
        flattened_part_of(value) is not None


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


def marks_of(value: Any) -> tuple:
    """What ``value`` is marked as (a part, a channels-last part, replicated), for :func:`marked`."""
    if not isinstance(value, torch.Tensor):
        return (None, None, False)
    return (part_of(value), channels_last_part_of(value), is_replicated(value))


def marked(tensor: torch.Tensor, marks: tuple) -> torch.Tensor:
    """``tensor`` marked with ``marks`` (from :func:`marks_of`); returns it."""
    part, channels_last, replicated = marks
    if part is not None:
        tagged(tensor, part)
    if channels_last is not None:
        tagged_channels_last(tensor, channels_last)
    if replicated:
        mark_replicated(tensor)
    return tensor


def with_marks_of(copy: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """``copy`` (of ``original``, on another device, say) marked as ``original`` is: the same
    part (channels-last or not), or replicated."""
    return marked(copy, marks_of(original))


def tensors_in(values) -> list:
    """The tensors among ``values``, and in the lists and tuples among them."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(tensors_in(value))
    return out


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
