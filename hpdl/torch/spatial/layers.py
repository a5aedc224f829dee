"""The operations of a CNN's spatial part, computed on one rank's part of each feature map
exactly as one process computes them on the whole.

Each handler takes the arguments of the PyTorch function it replaces (``F.conv2d``,
``F.max_pool2d``, ``F.batch_norm``, ...), as the dispatch mode hands them over, and returns
this rank's part of the result, marked with its :class:`Part`:

- window operations (convolution, pooling, bilinear and bicubic interpolation) exchange the
  rows and columns their output band reads (halo.py), then run PyTorch's own operation with
  no padding: fill beyond the image stands for it;
- ``pixel_shuffle`` and nearest upsampling are local, then move whole rows so that the result
  is split as every map is (geometry.py: the same rule for every size);
- batch normalization takes its statistics over the whole image (every rank of the group),
  as one process does; global average pooling sums over the group and hands every rank the
  same (replicated) result.

Gradient bookkeeping (what ``SpatialParallel`` relies on): a part's gradient is exact on its
owner once the halo gradients have come back; a replicated tensor's gradient on each rank is
that rank's contribution, and global pooling's backward sums the contributions.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from hpdl.torch import batch_norm_stats as stats
from hpdl.torch.spatial import halo
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import BandPlan, Part, SpatialError, ThinBand, Window, bands, plan_bands
from hpdl.torch.spatial.parts import part_of, tagged


def _arg(args: Sequence[Any], kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _pair(value: Any) -> Tuple[int, int]:
    if isinstance(value, (tuple, list)):
        return (int(value[0]), int(value[-1])) if len(value) else (0, 0)
    return int(value), int(value)


# -- plans ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _window_plans(length: int, parts: int, window: Window) -> Tuple[int, Tuple[BandPlan, ...]]:
    """The output length and every band's plan for ``window`` along one dimension."""
    out_length = window.output_length(length)
    out_bands = bands(out_length, parts)
    return out_length, tuple(plan_bands(bands(length, parts), [window.needed(b) for b in out_bands], length))


@functools.lru_cache(maxsize=4096)
def _regroup_plans(owned: Tuple[Tuple[int, int], ...], length: int) -> Tuple[BandPlan, ...]:
    """Plans that move rows from ``owned`` bands to the even split of ``length`` rows."""
    return tuple(plan_bands(owned, bands(length, len(owned)), length))


def _spec(ctx: Context, plans: Tuple[BandPlan, BandPlan], fill: str) -> halo.HaloSpec:
    return halo.HaloSpec(rows=plans[0], cols=plans[1], row_peers=ctx.grid.neighbours(ctx.rank, 0),
                         col_peers=ctx.grid.neighbours(ctx.rank, 1), fill=fill, comm=ctx.comm, label=ctx.label())


def window_spec(ctx: Context, part: Part, windows: Tuple[Window, Window], fill: str) -> Tuple[halo.HaloSpec, Part]:
    """The exchange ``windows`` (rows, columns) need on this rank, and the output's part."""
    lengths, plans = [], []
    for axis, window in enumerate(windows):
        try:
            out_length, all_plans = _window_plans(part.length(axis), ctx.grid.bands_along(axis), window)
        except ThinBand as thin:
            thin.layer, thin.axis = ctx.where(), axis
            raise
        lengths.append(out_length)
        plans.append(all_plans[part.band[axis]])
    return _spec(ctx, (plans[0], plans[1]), fill), part.resized(lengths[0], lengths[1])


def regroup(ctx: Context, y: torch.Tensor, part: Part, factors: Tuple[int, int]) -> torch.Tensor:
    """``y``, this rank's rows and columns of a map ``factors`` times ``part``'s size that a
    local operation made (rows ``factor * band``), moved to the even split of that map."""
    plans = []
    for axis, factor in enumerate(factors):
        owned = tuple((factor * a, factor * b) for a, b in bands(part.length(axis), ctx.grid.bands_along(axis)))
        plans.append(_regroup_plans(owned, factor * part.length(axis))[part.band[axis]])
    out = halo.exchange(y, _spec(ctx, (plans[0], plans[1]), halo.ZEROS))
    return tagged(out, part.resized(factors[0] * part.height, factors[1] * part.width))


# -- convolution ---------------------------------------------------------------------------

class HaloConv2d(torch.autograd.Function):
    """A convolution of the band's window input. Keeps only its own input and the received
    strips for backward (not the assembled window input, which would double the activations'
    memory), and computes the gradients with the convolution's own backward kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: halo.HaloSpec, stride, dilation, groups):
        assembled, row_strips, col_strips = halo.receive_both(x, spec)
        ctx.save_for_backward(x, weight, *row_strips, *col_strips)
        ctx.spec, ctx.stride, ctx.dilation, ctx.groups = spec, stride, dilation, groups
        ctx.has_bias = bias is not None
        return F.conv2d(assembled, weight, bias, stride, 0, dilation, groups)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, row_before, row_after, col_before, col_after = ctx.saved_tensors
        spec = ctx.spec
        assembled = halo.assemble_both(x, spec, (row_before, row_after), (col_before, col_after))
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
        grad_in, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_output.contiguous(), assembled, weight, [weight.shape[0]] if ctx.has_bias else None,
            list(ctx.stride), [0, 0], list(ctx.dilation), False, [0, 0], ctx.groups, mask)
        if grad_in is not None:
            grad_in = halo.adjoint_both(grad_in, spec, tuple(x.shape[-2:]))
        return grad_in, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None


class BandConv2d(torch.autograd.Function):
    """A stride-1 convolution whose band reads ``p`` rows beyond each of its ends and needs
    nothing else (row bands; a 1 x 1 grid): PyTorch's convolution of the band alone with its own
    zero padding, then the received rows' contributions added to its first and last ``p``
    output rows, each a convolution of a strip ``3p`` rows high (the received rows, then zeros
    for the band's own, whose part the first convolution has). Exact (convolution is linear in
    its input), and no window input is assembled: no copy of the band, in forward or backward.
    Keeps its own input and the received strips for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: halo.HaloSpec, padding: Tuple[int, int], groups: int):
        row_dim = x.dim() - 2
        before, after = halo.receive(x, row_dim, spec.rows, spec.row_peers, spec.comm, spec.label)
        out = F.conv2d(x, weight, bias, 1, padding, 1, groups)
        p = padding[0]
        for strip, rows in ((before, out.narrow(row_dim, 0, p)), (after, out.narrow(row_dim, out.shape[row_dim] - p, p))):
            if strip is not None:
                rows.add_(F.conv2d(_strip_slab(strip, p, strip is before), weight, None, 1, (0, padding[1]), 1, groups))
        ctx.save_for_backward(x, weight, before, after)
        ctx.spec, ctx.padding, ctx.groups, ctx.has_bias = spec, padding, groups, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, before, after = ctx.saved_tensors
        p, q = ctx.padding
        grad_output = grad_output.contiguous()
        row_dim = grad_output.dim() - 2
        needs_input, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        mask = [needs_input, needs_weight, ctx.has_bias and ctx.needs_input_grad[2]]
        grad_in, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_output, x, weight, [weight.shape[0]] if ctx.has_bias else None, [1, 1], [p, q], [1, 1], False,
            [0, 0], ctx.groups, mask)
        strip_grads = []
        for strip, first in ((before, True), (after, False)):
            if strip is None:
                strip_grads.append(None)
                continue
            rows = grad_output.narrow(row_dim, 0 if first else grad_output.shape[row_dim] - p, p).contiguous()
            grad_slab, grad_w, _ = torch.ops.aten.convolution_backward(
                rows, _strip_slab(strip, p, first), weight, None, [1, 1], [0, q], [1, 1], False, [0, 0], ctx.groups,
                [needs_input, needs_weight, False])
            if grad_w is not None:
                grad_weight += grad_w
            strip_grads.append(grad_slab.narrow(row_dim, 0 if first else 2 * p, p) if needs_input else None)
        if needs_input:  # the strips' gradients go back to their owners; theirs come here
            spec = ctx.spec
            halo.give_back(grad_in, row_dim, spec.rows, spec.row_peers, spec.comm, tuple(strip_grads), spec.label)
        return grad_in, grad_weight, grad_bias if ctx.has_bias else None, None, None, None


def _strip_slab(strip: torch.Tensor, p: int, first: bool) -> torch.Tensor:
    """``p`` received rows and ``2p`` rows of zeros where the band's own rows are (before them
    for the strip after the band): the rows whose windows reach the strip, without the band."""
    row_dim = strip.dim() - 2
    zeros = strip.new_zeros(strip.shape[:row_dim] + (2 * p,) + strip.shape[row_dim + 1:])
    return torch.cat([strip, zeros] if first else [zeros, strip], row_dim)


def _band_padding(spec: halo.HaloSpec, windows: Tuple[Window, Window], rows: int) -> Optional[Tuple[int, int]]:
    """The padding with which :class:`BandConv2d` computes this rank's part, or None where it
    cannot: a stride-1, undilated window of ``p`` rows on each side (``q`` columns), whose rows
    come from the band itself plus ``p`` on each end, each from a neighbour or fill; whose
    columns are the band's own plus ``q`` of fill (row bands); and a band of ``2p`` rows or more."""
    (row_window, col_window), plans = windows, (spec.rows, spec.cols)
    if any(w.stride != 1 or w.dilation != 1 or w.pad_before != w.pad_after for w in windows):
        return None
    p, q = row_window.pad_before, col_window.pad_before
    if row_window.kernel != 2 * p + 1 or col_window.kernel != 2 * q + 1 or rows < 2 * p:
        return None
    cols = spec.cols
    if cols.recv_before or cols.recv_after or cols.send_before[1] > cols.send_before[0] \
            or cols.send_after[1] > cols.send_after[0] or cols.keep != (0, cols.owned) \
            or (cols.fill_before, cols.fill_after) != (q, q):
        return None
    r = plans[0]
    if r.keep != (0, r.owned) or any((fill, recv) not in ((p, 0), (0, p))
                                     for fill, recv in ((r.fill_before, r.recv_before), (r.fill_after, r.recv_after))):
        return None
    return p, q


def conv2d(ctx: Context, func, args, kwargs):
    x, weight = args[0], _arg(args, kwargs, 1, "weight")
    bias = _arg(args, kwargs, 2, "bias")
    stride, padding = _pair(_arg(args, kwargs, 3, "stride", 1)), _arg(args, kwargs, 4, "padding", 0)
    dilation, groups = _pair(_arg(args, kwargs, 5, "dilation", 1)), _arg(args, kwargs, 6, "groups", 1)
    part = part_of(x)
    kernel = tuple(weight.shape[-2:])
    if padding == "valid":
        pads = ((0, 0), (0, 0))
    elif padding == "same":  # stride 1 only (PyTorch's rule); the odd extra row goes after
        pads = tuple((d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for k, d in zip(kernel, dilation))
    else:
        pads = tuple((p, p) for p in _pair(padding))
    windows = tuple(Window(k, s, pb, pa, d) for k, s, (pb, pa), d in zip(kernel, stride, pads, dilation))
    spec, out_part = window_spec(ctx, part, windows, halo.ZEROS)
    if ctx.dry:
        return tagged(F.conv2d(halo.receive_both(x, spec)[0], weight, bias, stride, 0, dilation, groups), out_part)
    padding = _band_padding(spec, windows, part.local_size[0])
    if padding is not None:
        return tagged(BandConv2d.apply(x, weight, bias, spec, padding, groups), out_part)
    return tagged(HaloConv2d.apply(x, weight, bias, spec, stride, dilation, groups), out_part)


# -- pooling -------------------------------------------------------------------------------

def max_pool2d(ctx: Context, func, args, kwargs):
    x = args[0]
    kernel = _pair(_arg(args, kwargs, 1, "kernel_size"))
    stride = _arg(args, kwargs, 2, "stride")
    stride = kernel if stride is None or stride == [] or stride == () else _pair(stride)
    padding, dilation = _pair(_arg(args, kwargs, 3, "padding", 0)), _pair(_arg(args, kwargs, 4, "dilation", 1))
    ceil_mode, return_indices = _arg(args, kwargs, 5, "ceil_mode", False), _arg(args, kwargs, 6, "return_indices", False)
    if return_indices:
        raise SpatialError(f"{ctx.where()}: max pooling with return_indices=True is not supported in the spatial "
                           "part (the indices would be local to each rank's part)")
    windows = tuple(Window(k, s, p, p, d, bool(ceil_mode)) for k, s, p, d in zip(kernel, stride, padding, dilation))
    spec, out_part = window_spec(ctx, part_of(x), windows, halo.NEG_INF)
    return tagged(F.max_pool2d(halo.exchange(x, spec), kernel, stride, 0, dilation), out_part)


def avg_pool2d(ctx: Context, func, args, kwargs):
    x = args[0]
    kernel = _pair(_arg(args, kwargs, 1, "kernel_size"))
    stride = _arg(args, kwargs, 2, "stride")
    stride = kernel if stride is None or stride == [] or stride == () else _pair(stride)
    padding, ceil_mode = _pair(_arg(args, kwargs, 3, "padding", 0)), _arg(args, kwargs, 4, "ceil_mode", False)
    count_include_pad = _arg(args, kwargs, 5, "count_include_pad", True)
    divisor = _arg(args, kwargs, 6, "divisor_override")
    if ceil_mode:
        raise SpatialError(f"{ctx.where()}: average pooling with ceil_mode=True is not supported in the spatial part")
    windows = tuple(Window(k, s, p, p) for k, s, p in zip(kernel, stride, padding))
    spec, out_part = window_spec(ctx, part_of(x), windows, halo.ZEROS)
    out = F.avg_pool2d(halo.exchange(x, spec), kernel, stride, 0, False, True, divisor)
    if not count_include_pad and divisor is None and any(padding):
        # Divide by the pixels inside the image only: each window's share that is not fill.
        out = out / F.avg_pool2d(_inside_image(x, spec), kernel, stride, 0, False, True)
    return tagged(out, out_part)


def _inside_image(x: torch.Tensor, spec: halo.HaloSpec) -> torch.Tensor:
    """The band's window input as a 1 x 1 mask: 1 on pixels of the image (own or received), 0 on fill."""
    h, w = x.shape[-2:]
    tall = h if spec.rows.moves_nothing else spec.rows.assembled_length()

    def ones(rows: int, cols: int) -> Optional[torch.Tensor]:
        return x.new_ones((1, 1, rows, cols)) if rows and cols else None

    return halo.assemble_both(x.new_ones((1, 1, h, w)), spec, (ones(spec.rows.recv_before, w), ones(spec.rows.recv_after, w)),
                              (ones(tall, spec.cols.recv_before), ones(tall, spec.cols.recv_after)))


# -- resampling ----------------------------------------------------------------------------

def pixel_shuffle(ctx: Context, func, args, kwargs):
    x, factor = args[0], int(_arg(args, kwargs, 1, "upscale_factor"))
    return regroup(ctx, torch.pixel_shuffle(x, factor), part_of(x), (factor, factor))


_TAPS = {"bilinear": 1, "bicubic": 2}  # source rows read beyond the nearest, on each side


def _integer_scales(ctx: Context, part: Part, size: Any, scale_factor: Any) -> Tuple[int, int]:
    if size is not None:
        wanted = _pair(size)
        scales = (wanted[0] / part.height, wanted[1] / part.width)
    else:
        scales = tuple(float(s) for s in (scale_factor if isinstance(scale_factor, (tuple, list))
                                          else (scale_factor, scale_factor)))
    if any(s < 1 or s != int(s) for s in scales):
        raise SpatialError(f"{ctx.where()}: interpolation by {scales[0]:g} x {scales[1]:g} is not supported in the "
                           "spatial part (integer upscaling only)")
    return int(scales[0]), int(scales[1])


def interpolate(ctx: Context, func, args, kwargs):
    x = args[0]
    size, scale_factor = _arg(args, kwargs, 1, "size"), _arg(args, kwargs, 2, "scale_factor")
    mode, align_corners = _arg(args, kwargs, 3, "mode", "nearest"), _arg(args, kwargs, 4, "align_corners")
    antialias = _arg(args, kwargs, 6, "antialias", False)
    part = part_of(x)
    if x.dim() != 4 or mode not in ("nearest", "nearest-exact", "bilinear", "bicubic") or align_corners or antialias:
        detail = f"mode={mode!r}" + (", align_corners=True" if align_corners else "") + \
            (", antialias=True" if antialias else "")
        raise SpatialError(f"{ctx.where()}: interpolation with {detail} is not supported in the spatial part "
                           "(nearest, bilinear or bicubic, integer upscaling, align_corners=False)")
    scales = _integer_scales(ctx, part, size, scale_factor)
    if mode in ("nearest", "nearest-exact"):  # output row o reads row o // s: local, then regrouped
        return regroup(ctx, F.interpolate(x, scale_factor=scales, mode=mode), part, scales)
    # Output row o reads rows near (o + 0.5) / s - 0.5; the image's own rows are clamped to its
    # edge, which the replicated fill stands for. The assembled input starts at a whole row,
    # so the local interpolation's coordinates are the global ones shifted by it.
    taps = _TAPS[mode]
    plans, offsets = [], []
    for axis, s in enumerate(scales):
        length, parts = part.length(axis), ctx.grid.bands_along(axis)
        out_bands = bands(s * length, parts)
        needed = [(o0 // s - taps, -(-o1 // s) + taps) for o0, o1 in out_bands]
        try:
            all_plans = plan_bands(bands(length, parts), needed, length)
        except ThinBand as thin:
            thin.layer, thin.axis = ctx.where(), axis
            raise
        plans.append(all_plans[part.band[axis]])
        o0, o1 = out_bands[part.band[axis]]
        first = needed[part.band[axis]][0]
        offsets.append((o0 - s * first, o1 - o0))
    assembled = halo.exchange(x, _spec(ctx, (plans[0], plans[1]), halo.REPLICATE))
    out = F.interpolate(assembled, scale_factor=scales, mode=mode, align_corners=False)
    out = out.narrow(2, offsets[0][0], offsets[0][1]).narrow(3, offsets[1][0], offsets[1][1])
    return tagged(out, part.resized(scales[0] * part.height, scales[1] * part.width))


# -- batch normalization -------------------------------------------------------------------

class SpatialBatchNorm(torch.autograd.Function):
    """Batch normalization with the statistics of the whole image (all of the group's parts).

    Keeps its input, not the normalized result, for backward (as PyTorch's own batch norm),
    so that the activations are not held twice."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, comm, label):
        xs = x.to(stats.stat_dtype(x.dtype))
        rows = comm.allgather(stats.local_moments(xs), [1] * comm.size, label)
        total, mean, m2 = stats.combine_moments(rows)
        if total.item() <= 1:
            raise ValueError(f"{label}: expected more than 1 value per channel when training, got "
                             f"{int(total.item())} over the whole image")
        invstd = torch.rsqrt(m2 / total + eps)
        stats.update_running(running_mean, running_var, mean, m2, total, momentum)
        dims = xs.dim()
        out = (xs - stats.channel_view(mean, dims)) * stats.channel_view(invstd, dims)
        if weight is not None:
            out = out * stats.channel_view(weight.to(xs.dtype), dims) + stats.channel_view(bias.to(xs.dtype), dims)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.comm, ctx.label = total, comm, label
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd = ctx.saved_tensors
        xs = x.to(stats.stat_dtype(x.dtype))
        dims = xs.dim()
        normalized = (xs - stats.channel_view(mean, dims)) * stats.channel_view(invstd, dims)
        dy = grad_output.to(xs.dtype)
        local_sums = stats.gradient_sums(dy, normalized)
        channels = invstd.numel()
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = ctx.comm.allreduce_sum(local_sums.clone(), ctx.label)
            grad_input = stats.input_gradient(dy, normalized, sums, ctx.total, invstd, weight).to(grad_output.dtype)
        if weight is not None:  # this part's share; summed over the group by the optimizer (see parallel.py)
            grad_weight = local_sums[channels:].to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = local_sums[:channels].to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def batch_norm(ctx: Context, func, args, kwargs):
    x = args[0]
    running_mean, running_var = _arg(args, kwargs, 1, "running_mean"), _arg(args, kwargs, 2, "running_var")
    weight, bias = _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 4, "bias")
    training, momentum = _arg(args, kwargs, 5, "training", False), _arg(args, kwargs, 6, "momentum", 0.1)
    eps = _arg(args, kwargs, 7, "eps", 1e-5)
    part = part_of(x)
    if not training:  # running statistics: the same affine map on every pixel
        return tagged(F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps), part)
    if ctx.dry:
        return tagged(torch.empty_like(x), part)
    if ctx.recomputing:  # the forward already moved them
        running_mean = running_var = None
    out = SpatialBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, ctx.comm, ctx.label())
    return tagged(out, part)


# -- global reductions (to a replicated tensor) --------------------------------------------

class GlobalSum(torch.autograd.Function):
    """The sum over the whole image (every part), divided by ``divisor``; the same on every rank.

    Backward sums every rank's contribution to the result's gradient before handing each
    part its share: the result is replicated, so each rank's gradient of it is only its own
    part's contribution (see parallel.py)."""

    @staticmethod
    def forward(ctx, x, dims, keepdim, divisor, comm, label):
        ctx.shape, ctx.dims, ctx.keepdim, ctx.divisor, ctx.comm, ctx.label = x.shape, dims, keepdim, divisor, comm, label
        return comm.allreduce_sum(x.sum(dims, keepdim=keepdim).contiguous(), label) / divisor

    @staticmethod
    def backward(ctx, grad):
        total = ctx.comm.allreduce_sum(grad.contiguous().clone(), ctx.label) / ctx.divisor
        if not ctx.keepdim:
            for d in sorted(ctx.dims):
                total = total.unsqueeze(d)
        return total.expand(ctx.shape), None, None, None, None, None


def _global_sum(ctx: Context, x: torch.Tensor, dims: Tuple[int, ...], keepdim: bool, mean: bool) -> torch.Tensor:
    part = part_of(x)
    count = 1
    for d in dims:
        count *= part.height if d == x.dim() - 2 else part.width if d == x.dim() - 1 else x.shape[d]
    divisor = count if mean else 1
    if ctx.dry:
        return x.sum(dims, keepdim=keepdim)
    return GlobalSum.apply(x, dims, keepdim, divisor, ctx.comm, ctx.label())


def adaptive_avg_pool2d(ctx: Context, func, args, kwargs):
    x, size = args[0], _arg(args, kwargs, 1, "output_size")
    if _pair(size if size is not None else 1) != (1, 1):
        raise SpatialError(f"{ctx.where()}: adaptive average pooling to {size} is not supported in the spatial "
                           "part (only to 1 x 1, global pooling)")
    return _global_sum(ctx, x, (x.dim() - 2, x.dim() - 1), True, True)


def reduction(ctx: Context, func, args, kwargs):
    """``mean`` and ``sum`` (as functions or methods): over both image dimensions, a global
    reduction; over neither, element-wise as far as the split goes; over one, refused."""
    x = args[0]
    dims = _arg(args, kwargs, 1, "dim")
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
    dtype = kwargs.get("dtype")
    if isinstance(dims, torch.dtype):  # x.sum(torch.float64)
        dims, dtype = None, dims
    ndim = x.dim()
    dims = tuple(range(ndim)) if dims is None or dims == () or dims == [] else \
        tuple(sorted(d % ndim for d in (dims if isinstance(dims, (tuple, list)) else (dims,))))
    spatial = {ndim - 2, ndim - 1} & set(dims)
    if not spatial:  # the image dimensions stay the last two
        return tagged(func(*args, **kwargs), part_of(x))
    if len(spatial) == 1:
        raise SpatialError(f"{ctx.where()}: {func.__name__} over one image dimension only is not supported in the "
                           "spatial part (over both, or over neither)")
    if dtype is not None:
        x = x.to(dtype)
    return _global_sum(ctx, x, dims, keepdim, func.__name__ == "mean")
