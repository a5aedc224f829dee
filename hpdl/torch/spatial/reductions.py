"""Reductions over the whole image of a CNN's spatial part, to a replicated result, the same on
every rank of the group: global and adaptive average pooling and sums (``GroupSum`` of each
part's contribution), global max pooling and ``amax`` (``GlobalMax``: each rank's maxima and
their places in the whole image, gathered), ``var``/``std`` over the image
(``GlobalMoments``: batch norm's gathered moments), and vector norms (``GlobalNorm``: each
part's sum of ``|x|^p``, summed).

Gradient bookkeeping (what ``SpatialParallel`` relies on): a replicated tensor's gradient on
each rank is that rank's contribution; each reduction's backward first sums the contributions
over the group, then gives each part its share as one process does.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch

from hpdl.torch import batch_norm_stats as stats
from hpdl.torch.spatial import band_plans
from hpdl.torch.spatial.comm import refuse_graph_in_backward
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import SpatialError
from hpdl.torch.spatial.parts import part_of, tag_outputs, tagged


class GroupSum(torch.autograd.Function):
    """The sum of every rank's ``x`` over the group: a replicated result, the same on every rank.

    Backward sums every rank's gradient of it before handing it back: the result is
    replicated, so each rank's gradient of it is only its own part's contribution (see
    parallel.py)."""

    @staticmethod
    def forward(ctx, x, comm, label):
        ctx.comm, ctx.label = comm, label
        return comm.allreduce_sum(x.contiguous().clone(), label)

    @staticmethod
    def backward(ctx, grad):
        refuse_graph_in_backward(ctx.label)
        return ctx.comm.allreduce_sum(grad.contiguous().clone(), ctx.label), None, None


def _group_sum(ctx: Context, x: torch.Tensor) -> torch.Tensor:
    """:class:`GroupSum` of ``x`` (``x`` itself in a dry run, where nothing is exchanged)."""
    return x if ctx.dry else GroupSum.apply(x, ctx.comm, ctx.label())


def _global_sum(ctx: Context, x: torch.Tensor, dims: Tuple[int, ...], keepdim: bool, mean: bool) -> torch.Tensor:
    part = part_of(x)
    count = 1
    for d in dims:
        count *= part.height if d == x.dim() - 2 else part.width if d == x.dim() - 1 else x.shape[d]
    total = _group_sum(ctx, x.sum(dims, keepdim=keepdim))
    return total / count if mean else total


def adaptive_avg_pool2d(ctx: Context, func, a: dict):
    """Adaptive average pooling to ``k x l``: every rank adds its part's pixels into the output
    windows they fall in (PyTorch's windows: ``floor(o * n / k)`` to ``ceil((o + 1) * n / k)``),
    and the group sums the contributions, so every rank holds the whole pooled map (a
    pyramid pooling module's, VGG's 7 x 7 before its classifier). To 1 x 1, a global mean."""
    x, size = a["input"], a["output_size"]
    out = _pooled_size(size)
    if out is None:
        return _pooled_along_unsplit(ctx, func, x, size, "average")
    if out == (1, 1):
        return _global_sum(ctx, x, (x.dim() - 2, x.dim() - 1), True, True)
    part = part_of(x)
    pooled = x
    for axis, k in enumerate(out):
        weights = _window_means(part.length(axis), k, (part.rows, part.cols)[axis], x.dtype).to(x.device)
        pooled = torch.tensordot(pooled, weights, dims=([x.dim() - 2 + axis], [1])).movedim(-1, x.dim() - 2 + axis)
    return _group_sum(ctx, pooled)


def _pooled_along_unsplit(ctx: Context, func, x: torch.Tensor, size: Any, kind: str) -> torch.Tensor:
    """Adaptive pooling that keeps one image dimension (``None``): where the grid does not split
    the one it pools (the columns of row bands, pooled to ``(None, 1)``: strip pooling's row
    means), each rank pools its own whole rows as one process does; a
    part of a map of the pooled length there. Refused where that dimension is split."""
    part = part_of(x)
    sizes = _both(size)
    if any(s is not None and part.grid.bands_along(axis) > 1 for axis, s in enumerate(sizes)):
        raise SpatialError(f"{ctx.where()}: adaptive {kind} pooling to {size} is not supported in the spatial part "
                           "(None keeps an image dimension: the dimension it pools must not be split, and this "
                           f"is a {part.grid} grid; pool to a size in both)")
    out = func(x, size)
    return tagged(out, part.resized(*(part.length(axis) if s is None else s for axis, s in enumerate(sizes))))


def _both(size: Any) -> tuple:
    """An adaptive pooling's ``output_size`` as (rows, columns), ``None`` kept."""
    return tuple(size) if isinstance(size, (tuple, list)) else (size, size)


def _pooled_size(size: Any) -> Optional[Tuple[int, int]]:
    """An adaptive pooling's output size as (rows, columns); None where it keeps a dimension (None)."""
    sizes = _both(size)
    return None if any(s is None for s in sizes) else band_plans.pair(sizes)


def _window_means(length: int, k: int, rows: Tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """(k, rows) weights: output ``o`` of adaptive average pooling ``length`` rows to ``k`` takes
    1 / (its window's length) of each of the band's ``rows`` inside its window."""
    o = torch.arange(k)
    start, stop = (o * length) // k, ((o + 1) * length + k - 1) // k
    r = torch.arange(*rows)
    inside = (r[None, :] >= start[:, None]) & (r[None, :] < stop[:, None])
    return inside.to(dtype) / (stop - start).to(dtype)[:, None]


class GlobalMax(torch.autograd.Function):
    """The maximum over the whole image (every part) of ``x`` (..., h, w), and over its last
    ``merged`` dimensions before the image's, the same on every rank. One allgather of each
    rank's maxima and the whole image's places of its candidates. Backward sums every rank's
    gradient of the replicated result, then gives it as one process does: with ``spread``
    (``amax``) shared evenly among the values equal to the maximum, counted over the whole
    image (with ``nan_equal``, as ``x.max()`` shares it, among the NaNs where the maximum is
    NaN); else (max pooling, ``merged`` 0) to the one pixel it picks: the first maximum in the
    whole image's row-major order, the last NaN where there is one."""

    @staticmethod
    def forward(ctx, x, part, spread, merged, comm, label, nan_equal=False):
        h, w = x.shape[-2:]
        kept = x.shape[:x.dim() - 2 - merged]
        flat = x.detach().reshape(math.prod(kept), -1).to(torch.float64)  # every float type's values, exactly
        local = flat.amax(1)
        first_max = torch.argmax((flat == local[:, None]).to(torch.int8), 1)  # the first True
        nan = torch.isnan(flat)
        last_nan = flat.shape[1] - 1 - torch.argmax(nan.flip(1).to(torch.int8), 1)
        (r0, _), (c0, _) = part.rows, part.cols

        def placed(i):  # the whole image's row-major place of local place i (merged 0)
            return ((r0 + torch.div(i, w, rounding_mode="floor")) * part.width + c0 + i % w).to(torch.float64)

        mine = torch.stack([local, placed(first_max), torch.where(nan.any(1), placed(last_nan), -1.0)])
        rows = comm.allgather(mine.unsqueeze(0), [1] * comm.size, label)  # (ranks, 3, maps)
        maxima, first_places, nan_places = rows[:, 0], rows[:, 1], rows[:, 2]
        best = maxima.amax(0)
        ctx.spread, ctx.comm, ctx.label, ctx.shape = spread, comm, label, x.shape
        if spread:
            # Where the maximum is NaN no value equals it, as in one process: the count is 0, and
            # the gradient NaN throughout the map (0 times total / 0).
            equal = flat == best[:, None]
            ctx.save_for_backward(equal | (nan & torch.isnan(best)[:, None]) if nan_equal else equal)
        else:
            any_nan = torch.isnan(best)
            at_max = torch.where(maxima == best, first_places, torch.full_like(first_places, float("inf")))
            chosen = torch.where(any_nan, nan_places.amax(0), at_max.amin(0))
            own = torch.where(any_nan, nan_places[comm.rank] == chosen,
                              (first_places[comm.rank] == chosen) & (maxima[comm.rank] == best))
            ctx.save_for_backward(torch.where(any_nan, last_nan, first_max), own)
        return best.to(x.dtype).reshape(kept)

    @staticmethod
    def backward(ctx, grad):
        refuse_graph_in_backward(ctx.label)
        grad = grad.reshape(-1)
        if ctx.spread:
            (at_max,) = ctx.saved_tensors
            summed = ctx.comm.allreduce_sum(torch.cat([grad.to(torch.float64), at_max.sum(1).to(torch.float64)]),
                                            ctx.label)
            total, count = summed[:grad.numel()], summed[grad.numel():]
            out = at_max.to(grad.dtype) * (total / count).to(grad.dtype)[:, None]
        else:
            place, own = ctx.saved_tensors
            total = ctx.comm.allreduce_sum(grad.contiguous().clone(), ctx.label)
            out = grad.new_zeros(grad.numel(), math.prod(ctx.shape[-2:]))
            out.scatter_(1, place[:, None], torch.where(own, total, torch.zeros_like(total))[:, None])
        return out.reshape(ctx.shape), None, None, None, None, None, None


def _global_max(ctx: Context, x: torch.Tensor, spread: bool, merged: int = 0, nan_equal: bool = False) -> torch.Tensor:
    """:class:`GlobalMax` of ``x`` (the shapes alone in a dry run)."""
    if ctx.dry:
        return x.amax(tuple(range(x.dim() - 2 - merged, x.dim())))
    return GlobalMax.apply(x, part_of(x), spread, merged, ctx.comm, ctx.label(), nan_equal)


def extreme(ctx: Context, x: torch.Tensor, minimum: bool) -> torch.Tensor:
    """``x.max()`` or ``x.min()`` (no dimension: every element): the whole image's, the same on
    every rank, its gradient shared evenly among the values equal to it (the NaNs, where it is
    NaN), as PyTorch shares it."""
    part = part_of(x)
    sign = -1.0 if minimum else 1.0
    signed = tagged(sign * x, part) if minimum else x
    return sign * _global_max(ctx, signed, spread=True, merged=x.dim() - 2, nan_equal=True).reshape(())


class GlobalProduct(torch.autograd.Function):
    """``x.prod()`` (every element): the product of the parts' products, taken in rank order, the
    same on every rank. Backward sums every rank's gradient of the replicated result; a part's
    gradient is then the other parts' product times its own product's gradient, PyTorch's own
    (a zero in the part included)."""

    @staticmethod
    def forward(ctx, x, comm, label):
        own = x.detach().prod()
        products = comm.allgather(own.reshape(1), [1] * comm.size, label)
        total, others = torch.ones_like(own), torch.ones_like(own)
        for rank, product in enumerate(products):
            total = total * product
            if rank != comm.rank:
                others = others * product
        ctx.save_for_backward(x)
        ctx.others, ctx.comm, ctx.label = others, comm, label
        return total

    @staticmethod
    def backward(ctx, grad):
        refuse_graph_in_backward(ctx.label)
        (x,) = ctx.saved_tensors
        total = ctx.comm.allreduce_sum(grad.contiguous().clone(), ctx.label)
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (out,) = torch.autograd.grad(leaf.prod(), leaf, total * ctx.others)
        return out, None, None


def product(ctx: Context, x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``x.prod()`` (no dimension: every element, the image's too): :class:`GlobalProduct`."""
    if dtype is not None:
        x = tagged(x.to(dtype), part_of(x))
    if ctx.dry:
        return x.prod()
    return GlobalProduct.apply(x, ctx.comm, ctx.label())


def _aminmax(ctx: Context, x: torch.Tensor) -> Any:
    return torch.return_types.aminmax((extreme(ctx, x, minimum=True), extreme(ctx, x, minimum=False)))


# Calls that, given no dimension, reduce every element, the image's too: func -> (ctx, x, bound
# arguments) -> the whole image's result, the same on every rank (dispatch's ALONG calls).
OVER_EVERYTHING = {
    torch.max: lambda ctx, x, a: extreme(ctx, x, minimum=False),
    torch.Tensor.max: lambda ctx, x, a: extreme(ctx, x, minimum=False),
    torch.min: lambda ctx, x, a: extreme(ctx, x, minimum=True),
    torch.Tensor.min: lambda ctx, x, a: extreme(ctx, x, minimum=True),
    torch.aminmax: lambda ctx, x, a: _aminmax(ctx, x),
    torch.Tensor.aminmax: lambda ctx, x, a: _aminmax(ctx, x),
    torch.prod: lambda ctx, x, a: product(ctx, x, a.get("dtype")),
    torch.Tensor.prod: lambda ctx, x, a: product(ctx, x, a.get("dtype")),
}


class GlobalMoments(torch.autograd.Function):
    """The mean and variance (with ``correction``: 1 unbiased, 0 biased) over the whole image
    (every part) of ``x`` (..., h, w), and over its last ``merged`` dimensions before the
    image's, the same on every rank: every part's count, mean and sum of squared deviations
    gathered and combined exactly (batch norm's arithmetic). Backward sums every rank's
    gradients of the replicated results, then gives each value its share."""

    @staticmethod
    def forward(ctx, x, merged, correction, comm, label):
        kept = x.shape[:x.dim() - 2 - merged]
        flat = x.reshape(1, math.prod(kept), -1).to(stats.stat_dtype(x.dtype))
        total, mean, m2 = stats.combine_moments(comm.allgather(stats.local_moments(flat), [1] * comm.size, label))
        var = m2 / (total - correction)
        ctx.save_for_backward(x, mean)
        ctx.total, ctx.correction, ctx.comm, ctx.label, ctx.kept = total, correction, comm, label, kept
        return mean.to(x.dtype).reshape(kept), var.to(x.dtype).reshape(kept)

    @staticmethod
    def backward(ctx, grad_mean, grad_var):
        refuse_graph_in_backward(ctx.label)
        x, mean = ctx.saved_tensors
        count = mean.numel()
        grads = [g.reshape(-1) if g is not None else mean.new_zeros(count) for g in (grad_mean, grad_var)]
        summed = ctx.comm.allreduce_sum(torch.cat([g.to(mean.dtype) for g in grads]), ctx.label)
        g_mean, g_var = summed[:count], summed[count:]
        flat = x.reshape(count, -1).to(mean.dtype)
        out = (g_mean / ctx.total)[:, None] + (2 * g_var / (ctx.total - ctx.correction))[:, None] * (flat - mean[:, None])
        return out.to(x.dtype).reshape(x.shape), None, None, None, None


_MOMENTS = {"var": (False, False), "std": (True, False), "var_mean": (False, True), "std_mean": (True, True)}


def moments(ctx: Context, func, a: dict):
    """``var``, ``std``, ``var_mean`` and ``std_mean`` over both image dimensions (and any
    others: per-channel statistics of each sample, as AdaIN and instance norm written by hand
    take them): over the whole image, the same on every rank; over neither, as they are; over
    one, refused."""
    x, dims, keepdim = a["input"], a.get("dim"), bool(a.get("keepdim", False))
    correction = a.get("correction")
    if correction is None:
        correction = 1 if a.get("unbiased", True) else 0
    root, with_mean = _MOMENTS[func.__name__]
    dims, over_image = _reduced_dims(ctx, func.__name__, x, dims)
    if not over_image:
        return tag_outputs(func(x, dims, correction=correction, keepdim=keepdim), part_of(x))
    moved, merged = _next_to_the_image(x, dims)
    if ctx.dry:
        mean = var = moved.mean(tuple(range(x.dim() - 2 - merged, x.dim())))
    else:
        mean, var = GlobalMoments.apply(moved, merged, float(correction), ctx.comm, ctx.label())
    spread, mean = _kept(var.sqrt() if root else var, dims, keepdim), _kept(mean, dims, keepdim)
    return (spread, mean) if with_mean else spread


class GlobalNorm(torch.autograd.Function):
    """The ``p``-norm over the whole image (every part) of ``x`` along ``dims`` (kept as ones),
    the same on every rank: each part's sum of ``|x|^p``, summed over the group. Backward sums
    every rank's gradient of the replicated result, then gives each value PyTorch's own
    gradient of the norm (torch's norm_backward), 0 where the norm is 0."""

    @staticmethod
    def forward(ctx, x, p, dims, comm, label):
        local = (x * x if p == 2 else x.abs().pow(p)).sum(dims, keepdim=True)
        total = comm.allreduce_sum(local.contiguous(), label)
        norm = total.sqrt() if p == 2 else total.pow(1.0 / p)
        ctx.save_for_backward(x, norm)
        ctx.p, ctx.comm, ctx.label = p, comm, label
        return norm

    @staticmethod
    def backward(ctx, grad):
        refuse_graph_in_backward(ctx.label)
        x, norm = ctx.saved_tensors
        grad = ctx.comm.allreduce_sum(grad.contiguous().clone(), ctx.label)
        p = ctx.p
        if p == 1:
            out = x.sgn() * grad
        elif p == 2:
            out = grad * (x / norm).masked_fill(norm == 0, 0)
        elif p < 1:
            out = x.sgn() * x.abs().pow(p - 1).masked_fill(x == 0, 0) * grad * norm.pow(1 - p)
        elif p < 2:
            out = x.sgn() * x.abs().pow(p - 1) * (grad / norm.pow(p - 1)).masked_fill(norm == 0, 0)
        else:
            out = x * x.abs().pow(p - 2) * (grad / norm.pow(p - 1)).masked_fill(norm == 0, 0)
        return out, None, None, None, None


def vector_norm(ctx: Context, func, a: dict):
    """``torch.linalg.vector_norm``, ``torch.norm`` and ``Tensor.norm`` of an order p > 0 (2 by
    default; ``'fro'`` is 2) over both image dimensions (and any others): the whole image's
    norm, the same on every rank, its gradient PyTorch's (0 where the norm is 0); over neither,
    as it is; over one, refused. Orders inf and -inf are the largest and smallest magnitude
    (amax's gradient: shared evenly among the ties). Orders 0 and negative, and ``'nuc'``, are
    refused over the image."""
    x, keepdim, dtype = a["input"], bool(a.get("keepdim", False)), a.get("dtype")
    p = a.get("ord", a.get("p", 2))
    p = 2 if p == "fro" or p is None else p
    dims, over_image = _reduced_dims(ctx, func.__name__.replace("linalg_", ""), x, a.get("dim"))
    if isinstance(p, str) or (over_image and not (0 < float(p) or float(p) == -math.inf)):
        raise SpatialError(f"{ctx.where()}: a norm of order {p!r} over the image is not supported in the spatial "
                           "part (orders p > 0, and -inf: the whole image's sum of |x|^p, or its extreme)")
    if dtype is not None:
        x = tagged(x.to(dtype), part_of(x))
    if not over_image:
        return tag_outputs(torch.linalg.vector_norm(x, p, dims, keepdim), part_of(x))
    if math.isinf(float(p)):
        sign = 1.0 if float(p) > 0 else -1.0
        moved, merged = _next_to_the_image(tagged(x.abs() * sign, part_of(x)), dims)
        return _kept(_global_max(ctx, moved, spread=True, merged=merged), dims, keepdim) * sign
    if ctx.dry:
        norm = torch.linalg.vector_norm(x, p, dims, keepdim=True)
    else:
        norm = GlobalNorm.apply(x, float(p), dims, ctx.comm, ctx.label())
    return norm if keepdim else norm.squeeze(dims)


def counted(ctx: Context, func, a: dict):
    """``any``, ``all``, ``count_nonzero``, ``nansum`` and ``nanmean`` over both image
    dimensions (and any others; no dimension: all of them; a NaN check's ``torch.isnan(x).any()``):
    each part's own, summed over the group, the same on every rank (``nanmean``: the group's
    ``nansum`` over its count of numbers, as PyTorch divides them); over neither, as they are;
    over one, refused."""
    x, name = a["input"], func.__name__
    keepdim, dtype = bool(a.get("keepdim", False)), a.get("dtype")
    dims, over_image = _reduced_dims(ctx, name, x, a.get("dim"))
    kwargs = {} if name == "count_nonzero" else {"keepdim": keepdim}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if not over_image:
        return tag_outputs(func(x, dims, **kwargs), part_of(x))
    if name in ("any", "all"):
        ones = func(x, dims, **kwargs).to(torch.int64)
        total = _group_sum(ctx, ones)
        return total > 0 if name == "any" else total == ctx.grid.size
    if name == "nanmean":
        total = _group_sum(ctx, torch.nansum(x, dims, **kwargs))
        return total / _group_sum(ctx, (~torch.isnan(x)).sum(dims, keepdim=keepdim))
    return _group_sum(ctx, func(x, dims, **kwargs))


def logsumexp(ctx: Context, func, a: dict):
    """``logsumexp`` over both image dimensions (and any others: LSE pooling of a
    multiple-instance head): the whole image's, the same on every rank, computed as PyTorch
    computes it (the maximum taken out, an infinite one as 0); over neither, as it is; over
    one, refused. Its gradient, ``exp(x - result)``, follows from the group sum's."""
    x, keepdim = a["input"], bool(a.get("keepdim", False))
    dims, over_image = _reduced_dims(ctx, func.__name__, x, a.get("dim"))
    if not over_image:
        return tag_outputs(torch.logsumexp(x, dims, keepdim), part_of(x))
    moved, merged = _next_to_the_image(x, dims)
    part = part_of(x)
    top = _global_max(ctx, tagged(moved.detach(), part), spread=True, merged=merged)
    top = top.masked_fill(top.abs() == math.inf, 0)
    trailing = tuple(range(moved.dim() - 2 - merged, moved.dim()))
    shifted = tagged(torch.exp(moved - top.reshape(top.shape + (1,) * len(trailing))), part)
    return _kept(torch.log(_global_sum(ctx, shifted, trailing, False, False)) + top, dims, keepdim)


def window_over_the_image(ctx: Context, x: torch.Tensor, maximum: bool, divisor: Optional[int] = None) -> torch.Tensor:
    """A pooling window that is the whole image (``F.avg_pool2d(x, x.shape[2:])``, DenseNet's
    last ``avg_pool2d(out, 7)``): the global mean (or sum over ``divisor``), or the global maximum
    with max pooling's gradient (to the first maximum), (..., 1, 1), the same on every rank."""
    if maximum:
        return _global_max(ctx, x, spread=False)[..., None, None]
    part = part_of(x)
    total = _global_sum(ctx, x, (x.dim() - 2, x.dim() - 1), True, False)
    return total / (divisor if divisor else part.height * part.width)


def adaptive_max_pool2d(ctx: Context, func, a: dict):
    """Adaptive max pooling to 1 x 1 (global max pooling: CBAM's channel attention), the same
    on every rank; other sizes, and the indices, are refused."""
    x, size, indices = a["input"], a["output_size"], a.get("return_indices", False)
    if not indices and _pooled_size(size) is None:
        return _pooled_along_unsplit(ctx, func, x, size, "max")
    if indices or _pooled_size(size) != (1, 1):
        raise SpatialError(f"{ctx.where()}: adaptive max pooling to {size}" + (" with its indices" if indices else "")
                           + " is not supported in the spatial part (to 1 x 1, global, without indices)")
    return _global_max(ctx, x, spread=False)[..., None, None]


def amax(ctx: Context, func, a: dict):
    """``amax`` over both image dimensions (and any others): the global maximum; over neither,
    as it is; over one, refused."""
    x, dims, keepdim = a["input"], a.get("dim"), bool(a.get("keepdim", False))
    dims, over_image = _reduced_dims(ctx, func.__name__, x, dims)
    if not over_image:
        return tagged(torch.amax(x, dims, keepdim), part_of(x))
    # One process shares the gradient among every value equal to the maximum, whichever map it is in.
    moved, merged = _next_to_the_image(x, dims)
    return _kept(_global_max(ctx, moved, spread=True, merged=merged), dims, keepdim)


def amin(ctx: Context, func, a: dict):
    """``amin``: ``amax`` of the map negated, negated (its gradient, as amax's, shared among every
    value equal to the minimum, as one process shares it)."""
    x = a["input"]
    result = amax(ctx, func, {**a, "input": tagged(torch.neg(x), part_of(x))})
    out = torch.neg(result)
    return tagged(out, part_of(result)) if part_of(result) is not None else out  # a part where the image stays


def reduction(ctx: Context, func, a: dict):
    """``mean`` and ``sum`` (as functions or methods): over both image dimensions, a global
    reduction; over neither, element-wise as far as the split goes; over one, refused."""
    x = a["input"]
    dims, keepdim, dtype = a.get("dim"), bool(a.get("keepdim", False)), a.get("dtype")
    along_one = _along_one_image_dimension(ctx, func, x, dims, keepdim, dtype)
    if along_one is not None:
        return along_one
    dims, over_image = _reduced_dims(ctx, func.__name__, x, dims)
    if not over_image:  # the image dimensions stay the last two
        return tagged(func(x, dims, keepdim, dtype=dtype), part_of(x))
    if dtype is not None:
        x = tagged(x.to(dtype), part_of(x))
    return _global_sum(ctx, x, dims, keepdim, func.__name__ == "mean")


def _along_one_image_dimension(ctx: Context, func, x: torch.Tensor, dims: Any, keepdim: bool, dtype) -> Any:
    """A sum or mean over one image dimension, kept (IMDN's ``x.sum(3, keepdim=True).sum(2,
    keepdim=True)``): where that dimension is not split (the columns of a grid of row bands), each
    rank's own, a part of a map of length 1 there; where the map's other length is 1 and not
    split, the whole image's (the same on every rank). None where ``dims`` is not one image
    dimension; refused where it is but neither holds."""
    ndim = x.dim()
    given = dims if isinstance(dims, (tuple, list)) else (dims,) if dims is not None else ()
    named = {int(d) % ndim for d in given}
    image = named & {ndim - 2, ndim - 1}
    if len(image) != 1:
        return None
    part = part_of(x)
    axis = (ndim - 2, ndim - 1).index(image.pop())  # 0: the rows reduced, 1: the columns
    bands = (part.grid.rows, part.grid.cols)
    lengths = (part.height, part.width)
    if keepdim and bands[axis] == 1:
        kept = tuple(sorted(named))
        out = func(x, kept, keepdim=True, dtype=dtype) if dtype is not None else func(x, kept, keepdim=True)
        return tagged(out, part.resized(*(1 if i == axis else lengths[i] for i in (0, 1))))
    if keepdim and lengths[1 - axis] == 1 and bands[1 - axis] == 1:
        if dtype is not None:
            x = tagged(x.to(dtype), part)
        return _global_sum(ctx, x, tuple(sorted(named | {ndim - 2, ndim - 1})), True, func.__name__ == "mean")
    raise SpatialError(f"{ctx.where()}: {func.__name__} over one image dimension only is not supported in the "
                       "spatial part (over both, or over neither; over one, with keepdim=True, where the grid does not "
                       f"split it: this is a {part.grid} grid)")


def pixel_loss(ctx: Context, func, a: dict):
    """A loss of each pixel's own term (``F.l1_loss``, ``F.mse_loss``, ``F.smooth_l1_loss``,
    ``F.huber_loss``) of a part and its target, the same part: with ``reduction="none"`` the
    terms, a part; with ``"mean"`` or ``"sum"`` the whole image's, the same on every rank (the
    parts' sums added over the group, divided by the whole's count)."""
    x, target, name = a["input"], a["target"], func.__name__
    part = part_of(x)
    if part_of(target) != part:
        raise SpatialError(f"{ctx.where()}: F.{name} of a part and a target that is not the same part is not "
                           "supported in the spatial part (scatter the target with the image: net.scatter(t))")
    if a.get("size_average") is not None or a.get("reduce") is not None or a.get("weight") is not None:
        raise SpatialError(f"{ctx.where()}: F.{name} with size_average, reduce or weight is not supported in the "
                           "spatial part (reduction= alone; multiply the terms of reduction='none' by a weight)")
    reduction = a.get("reduction", "mean")
    options = {k: v for k, v in a.items() if k in ("beta", "delta")}
    terms = tagged(func(x, target, reduction="none", **options), part)
    if reduction == "none":
        return terms
    return _global_sum(ctx, terms, tuple(range(terms.dim())), False, reduction == "mean")


# -- the dimensions a reduction reduces ----------------------------------------------------

def _reduced_dims(ctx: Context, name: str, x: torch.Tensor, dims: Any) -> Tuple[Tuple[int, ...], bool]:
    """The dimensions reduction ``name`` reduces (non-negative, in order; none given: all of
    them), and whether they are the image's; one image dimension alone is refused."""
    ndim = x.dim()
    dims = tuple(range(ndim)) if dims is None or dims == () or dims == [] else \
        tuple(sorted(d % ndim for d in (dims if isinstance(dims, (tuple, list)) else (dims,))))
    image = {ndim - 2, ndim - 1} & set(dims)
    if len(image) == 1:
        raise SpatialError(f"{ctx.where()}: {name} over one image dimension only is not supported in the spatial "
                           "part (over both, or over neither)")
    return dims, bool(image)


def _next_to_the_image(x: torch.Tensor, dims: Tuple[int, ...]) -> Tuple[torch.Tensor, int]:
    """``x`` with the other dimensions of ``dims`` moved just before the image's, and how many
    they are: a reduction over the last ones is then the one asked for."""
    ndim = x.dim()
    others = [d for d in dims if d < ndim - 2]
    if not others:
        return x, 0
    kept = [d for d in range(ndim - 2) if d not in others]
    return tagged(x.permute(*kept, *others, ndim - 2, ndim - 1), part_of(x)), len(others)


def _kept(out: torch.Tensor, dims: Tuple[int, ...], keepdim: bool) -> torch.Tensor:
    """A reduction's result with its reduced ``dims`` kept as ones, where ``keepdim``."""
    for d in sorted(dims) if keepdim else ():
        out = out.unsqueeze(d)
    return out
