"""Parts whose image dimensions are not the last two: channels-last blocks.

ConvNeXt's block (torchvision's CNBlock, timm's) and its LayerNorm2d move the channels last
(``x.permute(0, 2, 3, 1)``), then normalize and mix each pixel's channels (``nn.LayerNorm(C)``,
``nn.Linear(C, 4 * C)``, GELU, a layer scale), and move them back (``permute(0, 3, 1, 2)``).
All of that works on each pixel alone: on its part, a rank computes what one process computes
on the same pixels. So a part permuted that way keeps its part, under the channels-last mark
(parts.py), and only these calls run on it:

- element-wise calls, with tensors constant over the image beside it (a layer scale of C
  numbers) or the same part, channels-last; random ones draw from the band's own stream;
- ``F.linear`` and ``x @ w`` (a weight of two dimensions), which mix the channels;
- ``F.layer_norm`` and ``F.rms_norm`` over the channels alone (a ``normalized_shape`` of one length);
- reductions, ``softmax`` and their kin along the channels or the batch (``x.mean(-1, keepdim=True)``
  of a LayerNorm written by hand), ``cat``, ``chunk`` and ``split`` along them; means, sums,
  maxima, variances and norms over both image dimensions, the whole image's (ConvNeXt V2's
  global response norm: ``torch.norm(x, p=2, dim=(1, 2), keepdim=True)``);
- conversions, new tensors like it, the part's lengths (``b, h, w, c = x.shape``), and
  ``x.new_empty((b, 1, 1, 1))`` of a drop path (a size not read from the part);
- a permute: back to the image dimensions last (a part again), or keeping the channels last.

Everything else is refused on every rank alike, naming the call: a convolution, pooling, a
reshape, an index, a reduction over the image, and an element-wise call that reads dimension
1 as the channels (LocalResponseNorm, PReLU's per-channel weights, Dropout2d), where a
channels-last tensor holds the rows.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from hpdl.torch.spatial import lengths, ops, randomness
from hpdl.torch.spatial.arguments import Unbound, by_name
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import Part, SpatialError
from hpdl.torch.spatial.lengths import PartLength, to_local, to_whole
from hpdl.torch.spatial.ops import Kind
from hpdl.torch.spatial.parts import (channels_last_part_of, is_part, part_of, tagged, tagged_channels_last,
                                      tensors_in)


def run(ctx: Context, func, op: Optional[ops.Op], part: Part, args, kwargs):
    """``func`` called on a channels-last part (``part``'s image dimensions before the last)."""
    special = _SPECIAL.get(func)
    if special is not None:
        return special(ctx, func, part, args, kwargs)
    rule = _RULES.get(op.kind) if op is not None else None
    if rule is None:
        raise refusal(ctx, func)
    if op.across_dim_1:
        raise refusal(ctx, func, why="it works across dimension 1, which is the image's rows here")
    return rule(ctx, func, op, part, args, kwargs)


def refusal(ctx: Context, func, what: str = "", why: str = "") -> SpatialError:
    """The error for ``func`` on a channels-last part, naming the running module."""
    return SpatialError(
        f"{ctx.where()}: {what or ops.spelled(func)} on a part whose image dimensions are not the last two (its "
        f"channels moved last, as by x.permute(0, 2, 3, 1)) is not supported in the spatial part ("
        + (f"{why}; " if why else "")
        + "there only calls on each pixel's channels run: element-wise, F.linear, layer_norm over the channels, "
          "reductions along the channels; permute the image dimensions back to the last two first)")


# -- rules, by the op table's kind -----------------------------------------------------------

def _elementwise(ctx, func, op, part, args, kwargs):
    _check_operands(ctx, func, part, args, kwargs)
    return _as_channels_last(ctx, func, func(*to_whole(args), **to_whole(kwargs)), part)


def _random(ctx, func, op, part, args, kwargs):
    _check_operands(ctx, func, part, args, kwargs)
    return _as_channels_last(ctx, func, randomness.draw(ctx, func, ctx.rank, args, kwargs), part)


def _keeps_part(ctx, func, op, part, args, kwargs):
    return _as_channels_last(ctx, func, func(*to_whole(args), **to_whole(kwargs)), part)


def _convert(ctx, func, op, part, args, kwargs):
    """As dispatch's: another tensor converted like the part reads only its type and device."""
    if args and not is_part(args[0]):
        return func(*to_whole(args), **to_whole(kwargs))
    return _keeps_part(ctx, func, op, part, args, kwargs)


def _new(ctx, func, op, part, args, kwargs):
    """``x.new_empty(size)`` and its kin: of a size holding no length read from the part, the
    tensor one process makes (drop path's ``x.new_empty((b, 1, 1, 1)).bernoulli_(keep)``);
    of the part's lengths, or of its values, refused."""
    read_from_the_part = lengths.holds_length(args[1:]) or lengths.holds_length(kwargs)
    if read_from_the_part or any(is_part(t) for t in tensors_in(args[1:])):
        raise refusal(ctx, func, why="a new tensor of its lengths or values is refused on a channels-last part; "
                                     "use zeros_like and its kin, which keep it a part")
    return func(*args, **kwargs)


def _metadata(ctx, func, op, part, args, kwargs):
    return func(*args, **kwargs)


def _shape(ctx, func, op, part, args, kwargs):
    result = func(*args, **kwargs)
    x = args[0]
    h, w = part.local_size
    rows = PartLength(h, part.height, lengths.ROWS, exact=True)
    cols = PartLength(w, part.width, lengths.COLS, exact=True)
    if isinstance(result, torch.Size):
        return torch.Size(list(result[:-3]) + [rows, cols, result[-1]])
    if func is torch.Tensor.size:
        d = int(kwargs.get("dim", args[1] if len(args) > 1 else None)) % x.dim()
        return rows if d == x.dim() - 3 else cols if d == x.dim() - 2 else result
    # numel, nelement, nbytes: the whole's count of the same elements
    return PartLength(result, result // max(1, h * w) * part.height * part.width)


def _permute(ctx, func, op, part, args, kwargs):
    # Where the image dimensions go: the same call on a shape-only tensor whose dimensions all
    # differ in size (dimension i of size i + 2: the image's, n - 3 and n - 2, of n - 1 and n).
    x = args[0]
    n = x.dim()
    probe = torch.empty(tuple(range(2, 2 + n)), device="meta")
    moved = func(probe, *to_local(args[1:]), **to_local(kwargs))
    out = func(*to_local(args), **to_local(kwargs))
    if tuple(moved.shape[-2:]) == (n - 1, n):
        return tagged(out, part)
    if tuple(moved.shape[-3:-1]) == (n - 1, n):
        return tagged_channels_last(out, part)
    raise refusal(ctx, func, why="it moves the image dimensions apart or out of order")


def _along(ctx, func, op, part, args, kwargs):
    bound = _bound(ctx, func, args, kwargs)
    if isinstance(bound.get("other"), torch.Tensor):  # torch.max(a, b): element-wise
        return _elementwise(ctx, func, op, part, args, kwargs)
    x = bound.get("input", args[0] if args else None)
    if channels_last_part_of(x) != part and not _constant_over_the_image(x):
        raise refusal(ctx, func, why="its input must be the part, or of size 1 in the two dimensions before the "
                                     "last (torch.gather of a whole map by a part's index reads its first rows on "
                                     "every band)")
    if any(part_of(t) is not None for t in tensors_in(list(args) + list(kwargs.values()))):
        raise refusal(ctx, func, why="a channels-last part meets a part whose image dimensions are last")
    n = x.dim()
    dims = op.dims_named(bound, n)
    if {n - 3, n - 2} <= dims and func in _OVER_THE_IMAGE and channels_last_part_of(x) == part:
        return _over_the_image(ctx, func, part, bound, dims)
    if dims & {n - 3, n - 2}:
        raise refusal(ctx, func, f"{ops.spelled(func)} along an image dimension")
    for name in op.same_part:
        value = bound.get(name)
        if isinstance(value, torch.Tensor) and channels_last_part_of(value) != part:
            raise refusal(ctx, func, why=f"its {name} must be the same part as its input: it names places pixel by "
                                         "pixel")
    result = func(*to_whole(args), **to_whole(kwargs))
    for t in tensors_in([result]):
        if t.dim() == n:  # the dimensions kept (keepdim, softmax, chunk, topk)
            _tag(ctx, func, t, part)
        elif t.dim() == n - len(dims) and n - 1 in dims:  # the channels reduced away: the image last again
            if tuple(t.shape[-2:]) != part.local_size:
                raise refusal(ctx, func, why="its result is not split as the image is")
            tagged(t, part)
        elif t.dim() == n - len(dims):  # dimensions before the image reduced away
            _tag(ctx, func, t, part)
        else:
            raise refusal(ctx, func, why="its result is not split as the image is")
    return result


def _concatenate(ctx, func, op, part, args, kwargs):
    bound = _bound(ctx, func, args, kwargs)
    tensors = bound.get("tensors", args[0] if args else ())
    dim = op.fixed if op.fixed is not None else bound.get(op.dim, 0)
    stacking = func is torch.stack
    n = tensors[0].dim() + (1 if stacking else 0)
    if int(dim) % n in ((n - 3, n - 2, n - 1) if stacking else (n - 3, n - 2)):  # stack: a new dimension
        raise refusal(ctx, func, f"{ops.spelled(func)} along or after an image dimension (dim={dim})")
    if any(channels_last_part_of(t) != part for t in tensors):
        raise refusal(ctx, func, why="every tensor joined must be the same part of a map of the same size, "
                                     "channels-last")
    return _as_channels_last(ctx, func, func(*args, **kwargs), part)


_RULES = {
    Kind.ELEMENTWISE: _elementwise, Kind.RANDOM: _random, Kind.CONVERT: _convert, Kind.LIKE: _keeps_part,
    Kind.PART_ATTRIBUTE: _keeps_part, Kind.METADATA: _metadata, Kind.SHAPE: _shape, Kind.PERMUTE: _permute,
    Kind.NEW: _new, Kind.ALONG: _along, Kind.CONCAT: _concatenate,
}


# -- calls of their own ----------------------------------------------------------------------

def _linear(ctx, func, part, args, kwargs):
    bound = _bound(ctx, func, args, kwargs)
    _only_input_split(ctx, func, part, bound)
    return _as_channels_last(ctx, func, func(*args, **kwargs), part)


def _matmul(ctx, func, part, args, kwargs):
    """``x @ w``, a weight of two dimensions: the channels mixed, as by F.linear."""
    x = args[0] if args else kwargs.get("input")
    other = args[1] if len(args) > 1 else kwargs.get("other")
    if channels_last_part_of(x) != part or not isinstance(other, torch.Tensor) or other.dim() != 2 \
            or is_part(other):
        raise refusal(ctx, func, why="only the part times a weight of two dimensions (x @ w) mixes its channels "
                                     "alone")
    return _as_channels_last(ctx, func, func(*args, **kwargs), part)


def _layer_norm(ctx, func, part, args, kwargs):
    bound = _bound(ctx, func, args, kwargs)
    shape = bound.get("normalized_shape")
    shape = (shape,) if isinstance(shape, int) else tuple(shape or ())
    if len(shape) != 1:
        raise refusal(ctx, func, why=f"normalized_shape {list(shape)} takes in the image dimensions; over the "
                                     "channels alone it is one length")
    _only_input_split(ctx, func, part, bound)
    return _as_channels_last(ctx, func, func(*to_whole(args), **to_whole(kwargs)), part)


def _prelu(ctx, func, part, args, kwargs):
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    if not isinstance(weight, torch.Tensor) or weight.numel() != 1 or is_part(weight):
        raise refusal(ctx, func, why="its weights run along dimension 1, the rows here; one weight for all runs")
    return _elementwise(ctx, func, None, part, args, kwargs)


def _reduction(ctx, func, part, args, kwargs):
    """A reduction (mean, sum, amax, var, a norm, ...): along the channels or the batch, as
    ALONG; over both image dimensions, the whole image's (_over_the_image)."""
    return _along(ctx, func, _REDUCING, part, args, kwargs)


def _over_the_image(ctx, func, part: Part, bound: dict, dims: set):
    """A reduction over both image dimensions (ConvNeXt V2's GRN: ``torch.norm(x, p=2, dim=(1, 2),
    keepdim=True)``; a channels-last head's ``x.mean((1, 2))``): the part with its channels moved
    back before the image, reduced by the op table's handler, the kept dimensions moved back."""
    x = bound["input"]
    n = x.dim()
    moved = tagged(x.movedim(-1, -3), part)
    places = {n - 3: n - 2, n - 2: n - 1, n - 1: n - 3}  # each dimension's place after the move
    result = ops.lookup(func).handler(ctx, func, {**to_whole(bound), "input": moved,
                                                  "dim": sorted(places.get(d, d) for d in dims)})
    if not bound.get("keepdim"):
        return result
    kept = [t.movedim(-3, -1) for t in tensors_in([result])]  # (..., C, 1, 1) to (..., 1, 1, C)
    return tuple(kept) if isinstance(result, tuple) else kept[0]


_REDUCING = ops.Op(Kind.ALONG, dim="dim")
_SPECIAL = {}
_REDUCTIONS = [func for func, _ in ops.functions(
    "mean sum amax amin var std var_mean std_mean norm any all count_nonzero nansum nanmean".split())]
for _func in _REDUCTIONS + [torch.linalg.vector_norm]:
    _SPECIAL[_func] = _reduction
# Those with a handler over the image: the op table's (reductions.py).
_OVER_THE_IMAGE = {func for func in _SPECIAL if ops.lookup(func) is not None and ops.lookup(func).kind is Kind.HANDLER}
for _names, _rule in (("linear", _linear), ("layer_norm rms_norm", _layer_norm), ("prelu", _prelu),
                      ("matmul", _matmul)):
    for _func, _ in ops.functions(_names.split()):
        _SPECIAL[_func] = _rule
_SPECIAL[torch.Tensor.__matmul__] = _matmul


# -- helpers -------------------------------------------------------------------------------

def _bound(ctx, func, args, kwargs) -> dict:
    try:
        return by_name(func, args, kwargs)
    except Unbound:
        raise refusal(ctx, func, why="its arguments could not be read") from None


def _only_input_split(ctx, func, part: Part, bound: dict) -> None:
    """The call's input is the part; its weights are not split."""
    if channels_last_part_of(bound.get("input")) != part:
        raise refusal(ctx, func, why="its input must be the part")
    if any(is_part(value) for name, value in bound.items() if name != "input"):
        raise refusal(ctx, func, why="its weights must not be parts of a map")


def _constant_over_the_image(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 3 and tuple(t.shape[-3:-1]) == (1, 1)


def _check_operands(ctx, func, part: Part, args, kwargs) -> None:
    """Every tensor beside the part is the same part, channels-last, or constant along the image
    (size 1 in the two dimensions before the last, where it has them): a layer scale of C numbers."""
    for t in tensors_in(list(args) + list(kwargs.values())):
        if part_of(t) is not None:
            raise refusal(ctx, func, why="a channels-last part meets a part whose image dimensions are last")
        other = channels_last_part_of(t)
        if other is not None:
            if other != part:
                raise refusal(ctx, func, why=f"parts of maps of different sizes, {part.height} x {part.width} and "
                                             f"{other.height} x {other.width}")
            continue
        if any(t.dim() >= d and t.shape[-d] != 1 for d in (2, 3)):
            raise refusal(ctx, func, why=f"a tensor beside the part (shape {list(t.shape)}) is not split; it must "
                                         "have size 1 in the two dimensions before the last")


def _tag(ctx, func, t: torch.Tensor, part: Part) -> None:
    if t.dim() < 3 or tuple(t.shape[-3:-1]) != part.local_size:
        raise refusal(ctx, func, why="its result is not split as the image is")
    tagged_channels_last(t, part)


def _as_channels_last(ctx, func, result, part: Part):
    """``result`` (a tensor, or a tuple or list of them) marked as ``part``, channels-last."""
    for t in tensors_in([result]):
        _tag(ctx, func, t, part)
    return result

