"""A part whose image dimensions are merged into its last one: ``x.flatten(2)``,
``x.view(n, c, -1)``, ``x.reshape(n, c, h * w)``, as squeeze-and-excitation blocks and hand-written
global pooling write it (``x.view(b, c, -1).mean(-1)``).

Such a tensor holds the part's pixels in the part's own row-major order, not the image's, so
nothing may read it as a sequence (a softmax over it, a product with another, a permute into
attention): a reduction over its last dimension (``sum``, ``mean``, ``amax``, ``amin``) is the whole
image's, computed on the part viewed back as its rows and columns, and a read of its shape
gives the merged length, the part's own with the whole image's (lengths.py). Anything else on
it is refused, naming the call.
"""

from __future__ import annotations

import torch

from hpdl.torch.spatial import ops, reductions
from hpdl.torch.spatial.arguments import Unbound, by_name
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import Part, SpatialError
from hpdl.torch.spatial.lengths import PartLength, to_whole
from hpdl.torch.spatial.ops import Kind
from hpdl.torch.spatial.parts import flattened_part_of, tagged, tensors_in

_REDUCTIONS = {torch.sum: reductions.reduction, torch.Tensor.sum: reductions.reduction,
               torch.mean: reductions.reduction, torch.Tensor.mean: reductions.reduction,
               torch.amax: reductions.amax, torch.Tensor.amax: reductions.amax,
               torch.amin: reductions.amin, torch.Tensor.amin: reductions.amin}
_FREE = (Kind.METADATA, Kind.PART_ATTRIBUTE)


def run(ctx: Context, func, op, part: Part, args, kwargs):
    """``func`` on a flattened ``part`` (the first tensor of its call that is one)."""
    x = args[0] if args else None
    kind = op.kind if op is not None else None
    if kind in _FREE:
        return func(*args, **kwargs)
    if kind is Kind.SHAPE and flattened_part_of(x) is part:
        return _shape(func, part, x, args, kwargs)
    handler = _REDUCTIONS.get(func)
    others = [t for t in tensors_in(list(args[1:]) + list(kwargs.values())) if flattened_part_of(t) is not None]
    if handler is not None and flattened_part_of(x) is part and not others:
        try:
            bound = {name: to_whole(value) for name, value in by_name(func, args, kwargs).items()}
        except Unbound:
            bound = {}
        dims = bound.get("dim")
        given = dims if isinstance(dims, (tuple, list)) else (dims,) if dims is not None else ()
        if bound and [int(d) % x.dim() for d in given] == [x.dim() - 1]:
            return _reduced_over_the_image(ctx, func, handler, part, x, bound)
    raise SpatialError(f"{ctx.where()}: {ops.spelled(func)} of a part flattened (x.flatten(2), x.view(n, c, -1)) is "
                       "not supported in the spatial part (it holds the part's pixels, not the image's in order: sum, "
                       "mean, amax or amin over its last dimension alone, the whole image's; keep the rows and columns "
                       "for anything else)")


def _reduced_over_the_image(ctx: Context, func, handler, part: Part, x: torch.Tensor, bound: dict):
    """The reduction over the last dimension, done over the rows and columns of the part viewed
    back: the whole image's, the same on every rank."""
    image = tagged(x.unflatten(-1, part.local_size), part)
    n = image.dim()
    keepdim = bool(bound.get("keepdim", False))
    out = handler(ctx, func, {**bound, "input": image, "dim": (n - 2, n - 1), "keepdim": keepdim})
    return out.squeeze(-1) if keepdim else out  # (..., 1, 1) as the flattened call's (..., 1)


def _shape(func, part: Part, x: torch.Tensor, args, kwargs):
    result = func(*args, **kwargs)
    merged = PartLength(part.local_size[0] * part.local_size[1], part.height * part.width)
    if isinstance(result, torch.Size):
        return torch.Size(list(result[:-1]) + [merged])
    if func is torch.Tensor.size:
        d = int(kwargs.get("dim", args[1] if len(args) > 1 else None)) % x.dim()
        return merged if d == x.dim() - 1 else result
    return PartLength(result, result // max(1, int(merged)) * merged.whole)  # numel, nelement, nbytes
