"""Runs a model's own forward on parts of feature maps: a torch function mode that sends every
PyTorch call touching a part to its spatial version.

The model is not rewritten: its modules and its functional calls (``F.interpolate`` in
SRResNet's forward, ``x.mean((2, 3))``, residual adds) run as written, and the mode sees each
call. A call that touches a part (a tensor marked by parts.py) is looked up in the op table
(ops.py: one entry per function object) and follows its kind's rule here, its arguments read
by name as PyTorch reads them (arguments.py); a call the table does not hold is refused with
a :class:`SpatialError` naming the module and the call. Nothing outside the table runs on a
part, so nothing can silently compute on one band as if it were the image.

Lengths read from a part are :class:`~hpdl.torch.spatial.lengths.PartLength`: the part's own
where they shape a tensor (``view``, ``reshape``, ``expand``, ``new_zeros``, ``torch.zeros``),
the whole image's everywhere else (an interpolation's size, a crop, arithmetic with tensors),
as one process reads them.

The mode also gives every parameter's gradient its factor (``Context.grad_scale``, see
parallel.py); a model's own autograd Functions are wrapped for it (custom_functions.py).
Per-module hooks keep the path of the running module for messages and labels (context.py).
"""

from __future__ import annotations

import contextlib
import numbers
import weakref
from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from hpdl.torch.spatial import (channels_last, custom_functions, flattened, gradient_scale, layers, lengths, ops,
                                randomness, reductions, resampling)
from hpdl.torch.spatial.arguments import Unbound, bind, by_name
from hpdl.torch.spatial.context import Context, active, make_active
from hpdl.torch.spatial.geometry import Part, SpatialError
from hpdl.torch.spatial.lengths import PartLength, holds_length, to_local, to_whole
from hpdl.torch.spatial.ops import Kind
from hpdl.torch.spatial.parts import (channels_last_part_of, flattened_part_of, is_part, map_tensors, part_of,
                                      tag_outputs, tagged, tagged_channels_last, tagged_flattened, tensors_in,
                                      with_marks_of)
from hpdl.torch.sync_batch_norm import SyncBatchNorm

_READS_ONLY = (Kind.SHAPE, Kind.METADATA, Kind.PART_ATTRIBUTE)


@contextlib.contextmanager
def running(ctx: Context) -> Iterator[None]:
    """Run the block as a spatial forward with ``ctx``: the mode on, ``ctx`` active on this thread."""
    previous = make_active(ctx)
    try:
        with SpatialMode(ctx), custom_functions.wrapped(active):
            yield
    finally:
        make_active(previous)


class SpatialMode(TorchFunctionMode):
    def __init__(self, ctx: Context):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ctx = self.ctx
        if ctx.dry:
            args, kwargs = _made_tensors_on_meta(args, kwargs)
        op = ops.lookup(func)
        if ctx.grad_scale != 1.0 and torch.is_grad_enabled() and (op is None or op.kind not in _READS_ONLY):
            args, kwargs = gradient_scale.scale_parameters(args, kwargs, ctx.grad_scale)
        part, last = _find_part(args, kwargs)
        if ctx.trace is not None:
            # Calls without a part too: a number a part's own length gave where PyTorch's C code
            # reads it (``s / y.shape[2:].numel()``: a torch.Size multiplies its plain values)
            # meets only a replicated tensor, and the record must show it (split_check.py).
            ctx.trace.append((ops.spelled(func), ctx.where(), _scalars(args), _scalars(kwargs)))
        try:
            if part is None:
                flat = _find_flattened(args, kwargs)
                if flat is not None:  # x.flatten(2) of a part (flattened.py)
                    return flattened.run(ctx, func, op, flat, args, kwargs)
                return _outside_parts(ctx, func, op, args, kwargs)
            if not last:  # a channels-last part (channels_last.py)
                return channels_last.run(ctx, func, op, part, args, kwargs)
            if op is None:
                raise refusal(ctx, ops.spelled(func))
            return _RULES[op.kind](ctx, func, op, part, args, kwargs)
        except SpatialError:
            raise
        except Exception as err:
            # Where PyTorch refused (a kernel larger than a part, shapes that do not match):
            # the first forward's dry run names the layer (split_check.py).
            if not hasattr(err, "hpdl_where"):
                try:
                    err.hpdl_where = ctx.where()
                except AttributeError:  # an exception type without a __dict__
                    pass
            raise


def _made_tensors_on_meta(args, kwargs):
    """The dry run's arguments, with the tensors the forward makes itself (``y - torch.tensor(
    mean).view(1, 3, 1, 1)``, on the CPU or a GPU) moved to the meta device where they meet its
    parts or parameters: PyTorch refuses to combine the two devices, where the real forward,
    all on one device, runs. A number held as a tensor of no dimensions stays: PyTorch combines
    it with any device, and its value may be read."""
    found: List[torch.Tensor] = []
    map_tensors((args, kwargs), found.append)
    if not any(t.is_meta for t in found) or all(t.is_meta or t.dim() == 0 for t in found):
        return args, kwargs
    return map_tensors(args, _on_meta), map_tensors(kwargs, _on_meta)


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    # A part it is stays one (``torch.ones(b, 1, h, w)`` of a part's lengths, made on the CPU).
    return t if t.is_meta or t.dim() == 0 else with_marks_of(t.to("meta"), t)


# The saved-tensor hooks of the checkpoints SpatialParallel makes itself (parallel.py), whose
# recomputation runs split; a non-reentrant torch.utils.checkpoint's hooks are the same kind.
_own_checkpoints: "weakref.WeakSet[Any]" = weakref.WeakSet()


def note_own_checkpoint() -> None:
    """The checkpoint SpatialParallel has just begun (its saved-tensor hooks on top) is its own."""
    hooks = _top_saved_tensor_hooks()
    if hooks is not None:
        _own_checkpoints.add(hooks[0])


def _top_saved_tensor_hooks() -> Optional[tuple]:
    """The innermost saved-tensor hooks (pack, unpack), or None (also where PyTorch cannot tell)."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False)
    except AttributeError:  # a PyTorch without it: nothing is refused for it
        return None


def _in_a_checkpoint_of_the_models_own() -> bool:
    """Whether the innermost saved-tensor hooks are a non-reentrant torch.utils.checkpoint's
    that SpatialParallel did not make (its backward would recompute the layer unsplit)."""
    hooks = _top_saved_tensor_hooks()
    if hooks is None:
        return False
    pack = hooks[0]
    return getattr(pack, "__qualname__", "").startswith("_checkpoint_hook.") and pack not in _own_checkpoints


def refusal(ctx: Context, what: str, why: str = "") -> SpatialError:
    """The error for ``what`` on a part, naming the running module."""
    return SpatialError(f"{ctx.where()}: {what} is not supported in the spatial part" + (f" ({why})" if why else ""))


# -- calls without a part ------------------------------------------------------------------

def _outside_parts(ctx: Context, func, op: Optional[ops.Op], args, kwargs):
    if op is not None and op.kind is Kind.RANDOM:
        sized = holds_length(args) or holds_length(kwargs)  # most draws (torch.rand(1)) are not: no binding
        part = _part_sized(ctx, func, "size", args, kwargs) if sized else None
        if part is not None:  # torch.randn(b, c, h, w) of a part's lengths: the part's own stream, as randn_like
            return tagged(randomness.draw(ctx, func, ctx.rank, args, kwargs, local=True), part)
        return randomness.draw(ctx, func, randomness.REPLICATED, args, kwargs)  # replicated: one stream for the group
    if ctx.trace is not None and func in _VALUE_READS and args and getattr(args[0], "is_meta", False):
        # The first forward's dry run has shapes only: a replicated value read as a number
        # (``loss.item()``, ``if y.mean() > t``) or an array (``.cpu().numpy()``) reads as 1
        # there (False for a truth value), alike for every rank's part; the real forward reads
        # the value, the same on every rank. Not 0: a number computed from it and a part's own
        # length (``s.item() / x.numel()`` reads the part's count) must differ from one
        # process's, for the dry run to see it (split_check.py, _compare_with_one_process).
        return _VALUE_READS[func](args[0])
    if not (holds_length(args) or holds_length(kwargs)):
        return func(*args, **kwargs)
    if op is not None and op.kind is Kind.FACTORY:
        return _new_tensor(ctx, func, args, kwargs)
    if op is not None and op.kind is Kind.EXPAND and _constant_over_the_image(args[0] if args else None):
        # A value per channel spread over a part's lengths (``pooled.expand(b, c, h, w)``): that part.
        part = _part_sized(ctx, func, _EXPANDED_TO.get(ops.aten_name(func), ""), args, kwargs)
        if part is not None:
            return tagged(func(*to_local(args), **to_local(kwargs)), part)
    if func is F.interpolate:  # a whole tensor resampled to a size read from a part: a part
        made = resampling.onto_part(ctx, _bound(ctx, func, args, kwargs))
        if made is not None:
            return made
    # A length read from a part, used outside any part: one process's number (``x.sum() / x.numel()``).
    return func(*to_whole(args), **to_whole(kwargs))


_VALUE_READS = {
    torch.Tensor.item: lambda t: False if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1,
    torch.Tensor.__float__: lambda t: 1.0,
    torch.Tensor.__int__: lambda t: 1,
    torch.Tensor.__index__: lambda t: 1,
    torch.Tensor.__bool__: lambda t: False,
    torch.Tensor.tolist: lambda t: torch.ones(t.shape, dtype=t.dtype).tolist(),
    torch.Tensor.cpu: lambda t: torch.ones(t.shape, dtype=t.dtype),
    torch.Tensor.numpy: lambda t: torch.ones(t.shape, dtype=t.dtype).numpy(),
}


# -- the rules of the op table's kinds -----------------------------------------------------

def _handler(ctx, func, op, part, args, kwargs):
    bound = _bound(ctx, func, args, kwargs)
    if ctx.builds_graph and torch.is_grad_enabled() and _in_a_checkpoint_of_the_models_own():
        raise refusal(ctx, ops.spelled(func), "it runs inside a torch.utils.checkpoint of the model's own "
                      "(use_reentrant=False), whose backward would recompute it on the part without its neighbours' "
                      "rows: checkpoint with SpatialParallel(checkpoint=[...]), which recomputes it split")
    if ctx.builds_graph and not torch.is_grad_enabled() and _requiring_grad(bound):
        # A layer's backward exchanges with the peers only through the graph built here. In a
        # training forward, a layer run with gradients off on tensors that require them has
        # its gradient computed by someone else: a custom autograd Function (its forward runs
        # with gradients off) or a reentrant torch.utils.checkpoint, whose backward would run
        # the layer on the bare part, silently wrong.
        raise refusal(ctx, ops.spelled(func), "it runs with gradients off on tensors that require them, as inside "
                      "a torch.autograd.Function's forward or a torch.utils.checkpoint of the model's own, whose "
                      "backward would see the part without its neighbours' rows: checkpoint with "
                      "SpatialParallel(checkpoint=[...]); in a torch.no_grad() block of your own, .detach() its input "
                      "and give its parameters requires_grad=False")
    return op.handler(ctx, func, {name: to_whole(value) for name, value in bound.items()})


def _requiring_grad(bound: dict) -> bool:
    return any(isinstance(value, torch.Tensor) and value.requires_grad for value in bound.values())


def _elementwise(ctx, func, op, part, args, kwargs):
    _refuse_rows_as_channels(ctx, func, op, args, kwargs)
    part = _check_operands(ctx, func, part, args, kwargs, skip_first=func in _PARAMETER_SECOND, broadcast=True)
    return _as_parts(ctx, func, func(*to_whole(args), **to_whole(kwargs)), part)


_PARAMETER_SECOND = {f for f in (torch.prelu, getattr(torch.nn.functional, "prelu", None), torch.Tensor.prelu)
                     if f is not None}  # its weight runs along the channels, not broadcast


def _random_part(ctx, func, op, part, args, kwargs):
    _check_operands(ctx, func, part, args, kwargs)
    return _as_parts(ctx, func, randomness.draw(ctx, func, ctx.rank, args, kwargs), part)


def _random_channels(ctx, func, op, part, args, kwargs):
    """Dropout of whole channels: the mask (a number per sample and channel, whatever the band's
    size) from the group's one stream, so every band drops the same channels."""
    _refuse_rows_as_channels(ctx, func, op, args, kwargs)
    _check_operands(ctx, func, part, args, kwargs)
    return _as_parts(ctx, func, randomness.draw(ctx, func, randomness.REPLICATED, args, kwargs), part)


def _refuse_rows_as_channels(ctx, func, op, args, kwargs) -> None:
    """A call across dimension 1 on a part of fewer than 4 dimensions, (C, H, W): it would work
    across the rows, which the ranks hold in bands."""
    x = args[0] if args else kwargs.get("input")
    if op.across_dim_1 and isinstance(x, torch.Tensor) and x.dim() < 4:
        raise refusal(ctx, ops.spelled(func), f"it works across dimension 1, which on a part of {x.dim()} dimensions "
                      "is the image's rows, not the channels")


def _keeps_part(ctx, func, op, part, args, kwargs):
    return _as_parts(ctx, func, func(*to_whole(args), **to_whole(kwargs)), part)


def _convert(ctx, func, op, part, args, kwargs):
    """A copy of the part in another type or device: the same part. Another tensor converted like
    the part (SwinIR's ``self.mean.type_as(x)``, ``mean.to(x)``) reads only the part's type and
    device, the same on every rank: that tensor, converted."""
    if args and not is_part(args[0]):
        return with_marks_of(func(*to_whole(args), **to_whole(kwargs)), args[0])
    return _keeps_part(ctx, func, op, part, args, kwargs)


def _along(ctx, func, op, part, args, kwargs):
    bound = _bound(ctx, func, args, kwargs)
    if isinstance(bound.get("other"), torch.Tensor):  # torch.max(a, b): element-wise
        return _elementwise(ctx, func, op, part, args, kwargs)
    x = bound.get("input", args[0] if args else None)
    if part_of(x) != part and not _constant_over_the_image(x):
        # torch.gather(whole, 1, index_part): each band would read the whole map's first rows.
        raise refusal(ctx, f"{ops.spelled(func)} of a tensor that is not the part, by a part",
                      "its input must be the part, or of size 1 in its last two dimensions")
    _refuse_channels_last_beside(ctx, func, tensors_in(list(args) + list(kwargs.values())))
    over_everything = reductions.OVER_EVERYTHING.get(func)
    if over_everything is not None and bound.get("dim") is None:  # x.max(): every dimension, the image's too
        return over_everything(ctx, x, bound)
    ndim = x.dim() if isinstance(x, torch.Tensor) else 4
    dims = op.dims_named(bound, ndim)
    touched = dims & {ndim - 2, ndim - 1}
    if touched:
        given = bound.get(op.dim) if op.dim else None
        raise refusal(ctx, f"{ops.spelled(func)} along an image dimension"
                      + (f" (dim={given})" if given not in (None, [], ()) else " (no dim: all of them)"))
    for name in op.same_part:
        value = bound.get(name)
        if isinstance(value, torch.Tensor) and part_of(value) != part:
            raise refusal(ctx, f"{ops.spelled(func)} whose {name} is not the same part as its input",
                          f"its {name} names places pixel by pixel: one of size 1 along the image is the image's "
                          "first pixel, which one band holds")
    return _as_parts(ctx, func, func(*to_whole(args), **to_whole(kwargs)), part)




def _concatenate(ctx, func, op, part, args, kwargs):
    bound = _bound(ctx, func, args, kwargs)
    tensors = bound.get("tensors", args[0] if args else ())
    dim = op.fixed if op.fixed is not None else bound.get(op.dim, 0)
    stacking = func in (torch.stack,)
    ndim = tensors[0].dim() + (1 if stacking else 0)
    if int(dim) % ndim in (ndim - 2, ndim - 1):
        raise refusal(ctx, f"{ops.spelled(func)} along an image dimension (dim={dim})")
    if any(part_of(t) != part for t in tensors):
        raise refusal(ctx, f"{ops.spelled(func)} of a part with a tensor that is not the same part of a map of the "
                      "same size")
    return _as_parts(ctx, func, func(*args, **kwargs), part)


def _reshape(ctx, func, op, part, args, kwargs):
    x = args[0]
    out = func(*to_local(args), **to_local(kwargs))
    size = part.local_size
    if isinstance(out, torch.Tensor) and out.dim() >= 1 and tuple(x.shape[-2:]) == size \
            and out.shape[-1] == size[0] * size[1] and tuple(out.shape[:-1]) == tuple(x.shape[:-2]):
        return tagged_flattened(out, part)  # the image dimensions merged last (flattened.py)
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or tuple(out.shape[-2:]) != size \
            or tuple(x.shape[-2:]) != size or _product(out.shape[:-2]) != _product(x.shape[:-2]):
        raise refusal(ctx, f"{ops.spelled(func)} that changes the image dimensions",
                      "they must stay the last two, whole")
    return tagged(out, part)


def _expand(ctx, func, op, part, args, kwargs):
    x = args[0]
    constant = x.dim() < 2 or _constant_over_the_image(x)
    if not (constant or part_of(x) == part):
        raise refusal(ctx, f"{ops.spelled(func)} of a tensor that is not split to a part's size",
                      "only a part, or a tensor of size 1 in its last two dimensions, can be expanded to a part")
    out = func(*to_local(args), **to_local(kwargs))
    if tuple(out.shape[-2:]) != part.local_size:
        raise refusal(ctx, f"{ops.spelled(func)} that changes the image dimensions",
                      "they must stay the last two, whole")
    return tagged(out, part)


def _permute(ctx, func, op, part, args, kwargs):
    # Where the image dimensions go, whatever the spelling (permute(0, 2, 3, 1), transpose(-1, 1),
    # movedim(...)): the same call on a shape-only tensor whose dimensions all differ in size.
    x = args[0]
    probe = torch.empty(tuple(range(2, 2 + x.dim())), device="meta")
    moved = func(probe, *to_local(args[1:]), **to_local(kwargs))
    if tuple(moved.shape[-3:-1]) == (x.dim(), x.dim() + 1):  # channels last: (N, H, W, C)
        return tagged_channels_last(func(*to_local(args), **to_local(kwargs)), part)
    if tuple(moved.shape[-2:]) != (x.dim(), x.dim() + 1):
        raise refusal(ctx, f"{ops.spelled(func)} that moves the image dimensions",
                      "they must stay the last two, or move together before the last (channels last)")
    return _as_parts(ctx, func, func(*to_local(args), **to_local(kwargs)), part)


def _index(ctx, func, op, part, args, kwargs):
    x, index = args[0], args[1]
    ndim = x.dim()
    lead, rows, cols = _image_index(ctx, index, ndim)
    if func is torch.Tensor.__setitem__:
        if rows is not None or cols is not None:
            raise refusal(ctx, "assigning to rows or columns of a part", "index the batch or channel dimensions only")
        _check_operands(ctx, func, part, args[2:], {})
        return func(x, to_local(index), *to_whole(args[2:]))
    out = x if lead is None else func(x, lead)
    if lead is not None:
        if not isinstance(out, torch.Tensor) or out.dim() < 2 or tuple(out.shape[-2:]) != part.local_size:
            raise refusal(ctx, "indexing that selects rows or columns of a part",
                          "index the batch or channel dimensions only")
        tagged(out, part)
    if rows is None and cols is None:
        return out
    return layers.crop(ctx, out, rows, cols)


def _image_index(ctx, index: Any, ndim: int) -> Tuple[Any, Optional[slice], Optional[slice]]:
    """``x[index]`` as (the index of the batch and channel dimensions, or None for all of them;
    the slice of the image's rows, or None for all; the slice of its columns, or None)."""
    entries = list(index) if isinstance(index, tuple) else [index]
    if any(e is None for e in entries) or entries.count(Ellipsis) > 1:
        if _keeps_image_dims(entries, ndim):
            return tuple(to_local(entries)), None, None
        raise refusal(ctx, "indexing that adds dimensions beside the image's",
                      "index the batch or channel dimensions only")
    full = slice(None)
    if Ellipsis in entries:
        at = entries.index(Ellipsis)
        after = entries[at + 1:]
        image = ([full] * 2 + after)[-2:]
        lead = entries[:at] + [Ellipsis] + after[:-2] + [full, full]
    elif len(entries) <= ndim - 2:
        image, lead = [full, full], entries
    else:
        image, lead = (entries[ndim - 2:] + [full, full])[:2], entries[:ndim - 2]
        if len(entries) > ndim:
            raise refusal(ctx, "indexing with more indices than dimensions")
    if any(isinstance(e, torch.Tensor) and e.dim() > 1 for e in lead):  # a mask of several dimensions merges them
        raise refusal(ctx, "indexing by a mask of several dimensions", "index the batch or channel dimensions only")
    slices = []
    for entry in image:
        if not isinstance(entry, slice):
            raise refusal(ctx, "indexing that selects rows or columns of a part",
                          "slice them (x[..., a:b, :]), or index the batch or channel dimensions only")
        step = lengths.whole(entry.step)
        if step is not None and step <= 0:
            raise ValueError("step must be greater than zero")  # PyTorch's own words for the whole image
        slices.append(None if entry == full else
                      slice(lengths.whole(entry.start), lengths.whole(entry.stop), None if step == 1 else step))
    plain = all(e == full or e is Ellipsis for e in lead if not isinstance(e, torch.Tensor))
    plain = plain and not any(isinstance(e, torch.Tensor) for e in lead)
    return (None if plain else tuple(to_local(lead))), slices[0], slices[1]


def _keeps_image_dims(entries: List[Any], ndim: int) -> bool:
    """Whether ``x[entries]`` (with new axes) leaves the last two dimensions whole and last."""
    if Ellipsis in entries:
        at = entries.index(Ellipsis)
        return all(isinstance(e, slice) and e == slice(None) for e in entries[at + 1:]) and \
            not any(isinstance(e, torch.Tensor) and e.dim() > 1 for e in entries[:at])
    consumed = [e for e in entries if e is not None]
    return len(consumed) <= ndim - 2 and not any(isinstance(e, torch.Tensor) and e.dim() > 1 for e in consumed)


def _shape(ctx, func, op, part, args, kwargs):
    result = func(*args, **kwargs)
    x = args[0]
    h, w = part.local_size
    if isinstance(result, torch.Size):
        return torch.Size(list(result[:-2]) + [PartLength(h, part.height, lengths.ROWS, exact=True),
                                               PartLength(w, part.width, lengths.COLS, exact=True)])
    if func in (torch.Tensor.size,):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        d = int(dim) % x.dim()
        if d == x.dim() - 2:
            return PartLength(h, part.height, lengths.ROWS, exact=True)
        if d == x.dim() - 1:
            return PartLength(w, part.width, lengths.COLS, exact=True)
        return result
    # numel, nelement, nbytes: the whole's count of the same elements
    return PartLength(result, result // max(1, h * w) * part.height * part.width)


def _metadata(ctx, func, op, part, args, kwargs):
    return func(*args, **kwargs)


def _new(ctx, func, op, part, args, kwargs):
    if any(is_part(t) for t in tensors_in(list(args[1:]) + list(kwargs.values()))):  # x.new_tensor(part): a copy
        raise refusal(ctx, f"{ops.spelled(func)} of a part's values", "copy it with .clone(), which keeps it a part")
    return _new_tensor(ctx, func, args, kwargs)


def _new_tensor(ctx, func, args, kwargs):
    """``x.new_zeros(size)``, ``torch.zeros(size)``: a part where the size ends in the lengths of
    a part (read from it, as they are), else the tensor one process makes."""
    part = _part_sized(ctx, func, "size", args, kwargs)
    if part is not None:
        return tagged(func(*to_local(args), **to_local(kwargs)), part)
    return func(*to_whole(args), **to_whole(kwargs))


# The argument of each expanding call that gives the result's size (a repeat's counts, on a
# tensor of one pixel, are that size).
_EXPANDED_TO = {"expand": "size", "broadcast_to": "size", "repeat": "repeats", "tile": "dims"}


def _constant_over_the_image(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[-2:]) == (1, 1)


def _part_sized(ctx, func, argument: str, args, kwargs) -> Optional[Part]:
    """The part whose map a tensor of the size given as ``argument`` is: where that size ends
    in a part's two image lengths, read from it as they are (``b, c, h, w = x.shape``); else None."""
    try:
        size = bind(func, ops.aten_name(func), args, kwargs).get(argument)
    except Unbound:
        return None
    if not isinstance(size, (list, tuple)) or len(size) < 2:
        return None
    rows, cols = size[-2], size[-1]
    if not (isinstance(rows, PartLength) and isinstance(cols, PartLength) and rows.exact and cols.exact
            and rows.axis == lengths.ROWS and cols.axis == lengths.COLS):
        return None
    whole = Part(ctx.grid, ctx.rank, rows.whole, cols.whole)
    return whole if whole.local_size == (int(rows), int(cols)) else None


def _as_parts(ctx, func, result, part: Part):
    """``result`` (a tensor, or a tuple or list of them) marked as ``part``: every tensor an
    operation on a part returns must still be split as the image is (its last two dimensions
    the part's), or it would pass for a replicated tensor."""
    size = part.local_size
    for t in tensors_in([result]):
        if t.dim() < 2 or tuple(t.shape[-2:]) != size:
            raise refusal(ctx, f"{ops.spelled(func)} whose result is not split as the image is",
                          "the image dimensions must stay the last two, whole")
    return tag_outputs(result, part)


def _refused(ctx, func, op, part, args, kwargs):
    raise refusal(ctx, ops.spelled(func), op.why)


_RULES = {
    Kind.HANDLER: _handler, Kind.ELEMENTWISE: _elementwise, Kind.RANDOM: _random_part,
    Kind.RANDOM_CHANNELS: _random_channels, Kind.CONVERT: _convert, Kind.LIKE: _keeps_part,
    Kind.ALONG: _along, Kind.CONCAT: _concatenate, Kind.RESHAPE: _reshape,
    Kind.EXPAND: _expand, Kind.PERMUTE: _permute, Kind.INDEX: _index, Kind.SHAPE: _shape,
    Kind.METADATA: _metadata, Kind.PART_ATTRIBUTE: _keeps_part, Kind.NEW: _new, Kind.FACTORY: _new,
    Kind.REFUSED: _refused,
}


# -- helpers -------------------------------------------------------------------------------

def _bound(ctx, func, args, kwargs) -> dict:
    try:
        return by_name(func, args, kwargs)
    except Unbound:
        raise refusal(ctx, ops.spelled(func), "its arguments could not be read") from None


def _check_operands(ctx, func, part: Part, args, kwargs, skip_first: bool = False, broadcast: bool = False) -> Part:
    """Every tensor beside the part must be the same part of a map of the same size, or constant
    along the image (sizes 1 in its last two dimensions): anything else would meet every band
    with the same pixels. With ``broadcast`` (an element-wise call), parts may also broadcast
    where each rank can do it alone (``_broadcast``). Returns the part the result is."""
    tensors = tensors_in(list(args) + list(kwargs.values()))
    if skip_first:
        tensors = tensors[:1]
    _refuse_channels_last_beside(ctx, func, tensors)
    others = set()
    for t in tensors:
        other = part_of(t)
        if other is not None:
            if other != part:
                others.add(other)
            continue
        if t.dim() >= 1 and t.shape[-1] != 1 or t.dim() >= 2 and t.shape[-2] != 1:
            raise refusal(ctx, f"{ops.spelled(func)} of a part with a tensor that is not split "
                               f"(shape {list(t.shape)})",
                          "a tensor beside a part must be a part of a map of the same size, or have size 1 "
                          "in its last two dimensions")
    if not others:
        return part
    result = _broadcast([part, *others]) if broadcast else None
    if result is None:
        other = next(iter(others))
        raise refusal(ctx, f"{ops.spelled(func)} of parts of maps of different sizes",
                      f"{part.height} x {part.width} and {other.height} x {other.width}" +
                      ("; parts broadcast only along an image dimension the grid does not split" if broadcast else ""))
    return result


def _broadcast(parts: List[Part]) -> Optional[Part]:
    """The part of the map that ``parts`` broadcast to, where each rank can broadcast its own:
    along each image dimension their lengths are equal, or some are 1 where the grid does not split
    that dimension (``x * x.mean(3, keepdim=True)`` on row bands: each rank holds whole rows, so
    its own column of means spreads along its own rows as one process spreads the whole column).
    None where they do not (a length 1 along a split dimension would meet every band with the
    first one's pixels)."""
    first = parts[0]
    if any((p.grid, p.rank) != (first.grid, first.rank) for p in parts):
        return None
    lengths = []
    for axis in (0, 1):
        seen = {p.length(axis) for p in parts}
        longer = seen - {1}
        if len(longer) > 1 or len(seen) > 1 and first.grid.bands_along(axis) > 1:
            return None
        lengths.append(max(seen))
    return first.resized(*lengths)


def _product(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _scalars(value: Any) -> Any:
    """``value`` with tensors as ``"T"`` and lengths as the whole's: what a call's record compares."""
    if isinstance(value, torch.Tensor):
        return "T"
    if isinstance(value, (list, tuple)):
        return tuple(_scalars(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _scalars(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _scalars(value.start), _scalars(value.stop), _scalars(value.step))
    if isinstance(value, (lengths.PartLength, lengths.PartFloat)):
        return value.whole
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)) or value is Ellipsis:
        return value
    if isinstance(value, numbers.Number) and hasattr(value, "item"):  # numpy's (np.prod(x.shape[2:]))
        return value.item()
    return type(value).__name__


def _refuse_channels_last_beside(ctx, func, tensors) -> None:
    """A part (image dimensions last) meets a channels-last one: their pixels are not aligned."""
    if any(channels_last_part_of(t) is not None for t in tensors):
        raise refusal(ctx, f"{ops.spelled(func)} of a part with a channels-last part",
                      "permute the image dimensions of both to the same places")


def _find_part(args, kwargs) -> Tuple[Optional[Part], bool]:
    """The part of the first tensor marked as one among the call's arguments, and whether its
    image dimensions are its last two (else it is channels-last); (None, True) where none is."""
    # Lists too, given by keyword as by position (torch.cat(tensors=[a, b]) made a tensor no one
    # took for a part, and the next convolution ran on the bare band).
    for value in list(args) + list(kwargs.values()):
        found = _mark(value)
        if found[0] is not None:
            return found
        if isinstance(value, (list, tuple)):
            for item in value:
                found = _mark(item)
                if found[0] is not None:
                    return found
    return None, True


def _find_flattened(args, kwargs) -> Optional[Part]:
    """The part of the first tensor among the call's arguments that is a part flattened, or None."""
    for value in list(args) + list(kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            part = flattened_part_of(item)
            if part is not None:
                return part
    return None


def _mark(value: Any) -> Tuple[Optional[Part], bool]:
    part = part_of(value)
    if part is not None:
        return part, True
    return channels_last_part_of(value), False


# -- the running module's path -------------------------------------------------------------

def refuse_unsplittable_modules(model: nn.Module) -> None:
    """Refuse, before anything runs, a model holding a module no layer of which can be split:
    a TorchScript module (its calls run in TorchScript's interpreter, where no hook reaches a
    layer), a compiled one (``torch.compile``: its graph runs PyTorch's kernels on the part, past
    the calls' spatial versions; dynamo refused it with an internal error about tracking a
    module), or a lazy module whose parameters are not made yet (it makes them at its first
    call, from its input, so the group could not agree on them, nor the optimizer hold them), or
    a SyncBatchNorm (PyTorch's or hpdl's: their statistics come from kernels and collectives of
    their own, which a part does not reach; batch norm here already takes the whole image's)."""
    for path, module in model.named_modules():
        where = f"{path or '(the model)'} ({type(module).__name__})"
        if isinstance(module, torch.jit.ScriptModule):
            raise SpatialError(f"{where}: a TorchScript module (torch.jit.script or torch.jit.trace) cannot be "
                               "split; wrap the module it was made from")
        if _compiled(module):
            raise SpatialError(f"{where}: a module compiled with torch.compile (or .compile()) cannot be split: "
                               "SpatialParallel runs the model's calls one by one; wrap the module it was made from, "
                               "uncompiled")
        if isinstance(module, (nn.SyncBatchNorm, SyncBatchNorm)):
            raise SpatialError(f"{where}: a SyncBatchNorm cannot be split: use nn.BatchNorm2d, whose statistics "
                               "SpatialParallel takes over the whole image (every part of the group) and the batch, "
                               "as one process")
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise SpatialError(f"{where}: its parameters are not made yet (a lazy module makes them at its first "
                               "call): run the model once on a small input before wrapping it, as for "
                               "DistributedDataParallel")


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` is torch.compile's wrapper or was compiled in place (``.compile()``);
    told by name, so that torch._dynamo (slow to import) is not imported for it."""
    kind = type(module)
    # .compile() keeps the compiled call in the module's own attributes (PyTorch 2.2 and later).
    return (kind.__name__ == "OptimizedModule" and kind.__module__.startswith("torch._dynamo")) \
        or vars(module).get("_compiled_call_impl") is not None
